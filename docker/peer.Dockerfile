# syntax=docker/dockerfile:1
# anchormesh peer: the daemon a volunteer runs (joins a run, serves one pipeline stage).
#
# Build from the repository root (the context must hold pyproject.toml, peer/ and bootstrap/):
#   CUDA base (default):  docker build -f docker/peer.Dockerfile -t anchormesh-peer .
#   CPU fallback:         docker build -f docker/peer.Dockerfile -t anchormesh-peer:cpu \
#                           --build-arg BASE=python:3.12-slim \
#                           --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
# The CUDA image gets torch from the default index (PyPI): torch 2.13.0's Linux x86_64 wheel is the
# CUDA 13.0 build (torch.version.cuda == "13.0"; its METADATA requires cuda-toolkit[...]==13.0.3 and
# nvidia-*-cu13 packages). Those pip packages bring the CUDA runtime, cuBLAS, cuDNN and NCCL, so the
# base only needs the driver-facing part: nvidia/cuda's `-base` image of the same CUDA version (its
# NVIDIA_REQUIRE_CUDA asks for cuda>=13.0, so the NVIDIA Container Toolkit refuses a too-old driver
# when the container starts; `-runtime` would add ~2 GB of CUDA libraries that torch does not load).
# The toolkit mounts the host's libcuda and /dev/nvidia* (mode 0666) into the container, so the
# non-root user below reaches the GPU without any group.
# Host: NVIDIA driver >= 580.65.06 (CUDA 13.0; any R580 or newer driver serves 13.x), a GPU of compute
# capability >= 7.5 (Turing or newer: CUDA 13 dropped Maxwell, Pascal and Volta), and the NVIDIA
# Container Toolkit. Run with `--gpus all --ipc=host` (hivemind's averager shares the stage's fp32
# state through /dev/shm; Docker's default 64 MB is too small): `docker run --gpus all --ipc=host ...`.
# The peer trains on the GPU with `--device auto` (the default) when the container sees one.
# peer.Dockerfile.dockerignore (beside this file) keeps .venv, runs and caches out of the context.

ARG BASE=nvidia/cuda:13.0.3-base-ubuntu22.04
FROM ${BASE}

# torch is installed first and pinned: 2.13.0 is the build the test suite runs with.
# TORCH_INDEX empty = the default index; the CPU build sets it to PyTorch's CPU wheel index.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.11+ in a venv: python:3.x images have one; Ubuntu 22.04 (the CUDA image) ships 3.10
# and no Python at all in the base image, so 3.11 comes from Ubuntu's own packages.
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

# non-root; /state is created here so a fresh named volume inherits its owner
RUN groupadd --gid 10001 anchormesh \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/anchormesh --shell /usr/sbin/nologin anchormesh \
    && mkdir -p /state && chown anchormesh:anchormesh /state
USER 10001:10001
WORKDIR /home/anchormesh
VOLUME /state

# 7100: the Stage gRPC service (--grpc-port); 7101: the peer's DHT node (--dht-port).
EXPOSE 7100 7101

# a peer serves only after it has joined, built its stage and downloaded its group's state
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --retries=3 \
    CMD ["anchormesh", "health", "--address", "127.0.0.1:7100"]

ENTRYPOINT ["anchormesh"]
# The default joins the run named by the environment: -e ANCHORMESH_TRACKER=HOST:7000 (or
# -e ANCHORMESH_INITIAL_PEERS="/ip4/..."), announcing the local address that routes to the tracker
# (`auto`: right with --network host or on a LAN). Behind NAT or a port forward, give the whole
# command instead (`docker run IMAGE peer ... --announce-host PUBLIC_IP`): arguments replace this list.
CMD ["peer", "--host", "0.0.0.0", "--announce-host", "auto", "--grpc-port", "7100", "--dht-port", "7101", "--state-dir", "/state"]
