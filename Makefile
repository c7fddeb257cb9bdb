PY ?= python
PROTOS := $(wildcard protos/sluice/v1/*.proto)

.PHONY: protos lint test sim check-protos

# Regenerate the committed gRPC code under sluice/v1/ from protos/.
protos:
	$(PY) tools/gen_protos.py

# buf lint (STANDARD + COMMENTS) and ruff.
lint:
	cd protos && buf lint
	ruff check .

# The README's test command.
test:
	ruff check . && $(PY) -m pytest -q

# The README's main command: the simulated baseline comparison.
sim:
	sluice simulate --trace sharegpt --policy vllm --policy vllm_chunked --policy sarathi --policy orca --policy sls --model llama-2-7b --hardware a100-80g --rate 2 --num-requests 400 --plot sim.png --json sim.json
