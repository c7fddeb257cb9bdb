# syntax=docker/dockerfile:1
# The OpenAI HTTP gateway: the base install and the gateway extra (Starlette, uvicorn with
# httptools and uvloop, Jinja for chat templates); no torch, no tokenizer: the scheduler
# tokenizes. It dials the scheduler at SLUICE_SCHEDULER.
#   docker build -f deploy/docker/gateway.Dockerfile -t sluice-gateway .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY . /src
RUN pip install "/src[gateway]"
RUN if python -c "import torch" 2>/dev/null; then echo "torch must not be in the gateway image" >&2; exit 1; fi

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HOST=0.0.0.0 SLUICE_PORT=8000 SLUICE_SCHEDULER=scheduler:50051
RUN useradd --system --uid 10001 --user-group --home-dir /home/sluice --create-home sluice
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-m", "sluice.common.healthcheck", "--http", "/health"]
ENTRYPOINT ["sluice", "gateway"]
