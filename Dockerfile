# One image for the operator, the pre-flight init container and the engine
# (entrypoint `kvledger`). Build it with `make image IMAGE=REGISTRY/kvledger:TAG`.
#
# BASE: any Debian- or Ubuntu-based image; Python 3.11+ is installed with apt when the
# base has none. The default is NVIDIA's CUDA base image, and the default torch is
# PyPI's Linux build, which carries its own CUDA libraries: a GPU image. The project's
# tests build a CPU image from a Debian base made locally (scripts/container_base.sh)
# with TORCH_PIN=torch==2.13.0 taken from a wheel folder (PIP_FIND_LINKS).
ARG BASE=docker.io/nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${BASE} AS python
# Python without compilers or headers; skipped when the base already has python3 + venv.
RUN if ! python3 -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM python AS build
# The torch build: a pin, and optionally another index (e.g. a CUDA variant's).
ARG TORCH_PIN=torch==2.13.0
ARG TORCH_INDEX_URL=""
# pip's own settings pass through as build args (a CA bundle or a wheel folder mounted
# with --volume, a mirror); they are not kept in the final image.
ARG PIP_CERT=""
ARG PIP_FIND_LINKS=""
ARG PIP_INDEX_URL=""
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/kvledger \
    && /opt/kvledger/bin/pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_PIN"
# Only what the package needs: no tests, benchmarks or docs.
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY operator /src/operator
RUN /opt/kvledger/bin/pip install --quiet /src \
    && /opt/kvledger/bin/pip uninstall --quiet --yes pip setuptools 2>/dev/null

FROM python
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kvledger" \
      org.opencontainers.image.description="Serve LLMs on Kubernetes without out-of-memory crashes: operator, pre-flight planner and engine" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/kvledger/kvledger"
# uid 1000, as the rendered pods run; a passwd entry so getpass/pwd lookups work.
RUN if ! getent passwd 1000 >/dev/null; then \
        echo 'kvledger:x:1000:1000:kvledger:/tmp:/usr/sbin/nologin' >> /etc/passwd; \
    fi \
    && if ! getent group 1000 >/dev/null; then echo 'kvledger:x:1000:' >> /etc/group; fi
COPY --from=build /opt/kvledger /opt/kvledger
# The root filesystem is read-only in the pods: every home and cache is under /tmp, an
# emptyDir there (pip compiled the byte code at install).
ENV PATH=/opt/kvledger/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 1000:1000
WORKDIR /tmp
ENTRYPOINT ["kvledger"]
CMD ["--help"]
