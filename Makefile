# Sluice: `make demo` runs the main job, `make test` runs the tests; both set up .venv first
# (torch==2.13.0 before the project, so the CPU wheel is used and no CUDA packages come in).
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
PYTHON ?= python3
# vLLM's CPU build where no NVIDIA driver answers, its CUDA build where one does.
VLLM_EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo vllm-cuda || echo vllm)

.PHONY: demo sim test lint protos install images

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[worker,predictor,gateway,dev,ray]"
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA)]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

install: $(VENV)/.installed

# The main job: the whole stack on CPU (scheduler + 2 workers with the tiny demo model), replaying
# a slice of the real Azure conversation trace against itself, then the metrics table.
demo: $(VENV)/.installed
	$(BIN)/sluice serve --demo --port 0

# The simulated comparison of the baselines on the real ShareGPT trace (table, JSON, plot).
sim: $(VENV)/.installed
	$(BIN)/sluice simulate --trace sharegpt --num-requests 500 --rate 1.5 --max-model-len 8192 \
		--policy vllm --policy vllm_chunked --policy sarathi --policy orca --policy sls \
		--model llama-2-7b --hardware a100-80g --json sim.json --plot sim.png

# The tests: ruff, then pytest (buf lint runs inside the tests).
test: $(VENV)/.installed
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/ruff check .
	PATH="$(abspath $(BIN)):$$PATH" $(PY) -m pytest -q

lint: $(VENV)/.installed
	cd protos && $(abspath $(BIN))/buf lint
	$(BIN)/ruff check .

# Regenerate the committed gRPC code under sluice/v1/ from protos/.
protos: $(VENV)/.installed
	$(PY) tools/gen_protos.py

# Container images (deploy/docker/; needs a Docker engine). `make images IMAGES="scheduler worker-cpu"`
# builds a few; tags are sluice-<name>:$(IMAGE_TAG), the names docker-compose.yml uses.
DOCKER ?= docker
IMAGE_TAG ?= latest
IMAGES ?= scheduler gateway worker-cpu worker-cuda predictor-cpu predictor-cuda
images:
	@for name in $(IMAGES); do \
		echo "== sluice-$$name:$(IMAGE_TAG)"; \
		$(DOCKER) build -f deploy/docker/$$name.Dockerfile -t sluice-$$name:$(IMAGE_TAG) . || exit 1; \
	done
