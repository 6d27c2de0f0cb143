# syntax=docker/dockerfile:1
# anchormesh bootstrap: the run's first DHT node, the tracker and the status service.
# It does no training, so the CPU base is the default.
#
# Build from the repository root:
#   docker build -f docker/bootstrap.Dockerfile -t anchormesh-bootstrap .
# bootstrap.Dockerfile.dockerignore (beside this file) keeps .venv, runs and caches out of the context.

ARG BASE=python:3.12-slim
FROM ${BASE}

# hivemind (the DHT node) imports torch: the CPU build is enough
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.11+ in a venv (same recipe as peer.Dockerfile, so BASE may be an Ubuntu 22.04 image too)
RUN set -eux; \
    if command -v python3 >/dev/null && python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
        PY=python3; \
    else \
        apt-get update; \
        apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
        PY=python3.11; \
    fi; \
    "$PY" -m venv /opt/anchormesh
ENV PATH=/opt/anchormesh/bin:$PATH
# model downloads land in the volume, so a new container does not fetch them again
ENV HF_HOME=/state/hf

RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md /src/
COPY peer /src/peer
COPY bootstrap /src/bootstrap
RUN pip install "/src[data]" && rm -rf /src

# the commit it was built from (`anchormesh --version`, each peer's build in the status): the image
# has no .git; build with --build-arg ANCHORMESH_COMMIT=$(git rev-parse --short HEAD)
ARG ANCHORMESH_COMMIT=unknown
ENV ANCHORMESH_COMMIT=$ANCHORMESH_COMMIT

# non-root; /state (bootstrap.json) is created here so a fresh named volume inherits its owner
RUN groupadd --gid 10001 anchormesh \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/anchormesh --shell /usr/sbin/nologin anchormesh \
    && mkdir -p /state && chown anchormesh:anchormesh /state
USER 10001:10001
WORKDIR /home/anchormesh
VOLUME /state

# 7000: tracker + status gRPC (--port); 7001: the run's first DHT node (--dht-port, TCP)
EXPOSE 7000 7001

HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["anchormesh", "health", "--address", "127.0.0.1:7000", "--tracker"]

ENTRYPOINT ["anchormesh"]
CMD ["bootstrap", "--host", "0.0.0.0", "--port", "7000", "--dht-port", "7001", "--state-dir", "/state"]
