#!/bin/sh
# A base image for the Dockerfile made from Debian's packages, for a host that reaches Debian's
# archive and PyPI but no container registry (run as root; `make compose-up` runs it when needed):
#   sh deploy/base-image.sh                     # -> tandem-base:bookworm
#   docker build --build-arg BASE=tandem-base:bookworm -t tandem:latest .
# It stands in for python:3.11-slim: Debian 12's Python 3.11 with pip and its headers (the CPU
# kernels build against them), `python` on the path, pip allowed to install into the system
# Python, wget for health checks. The archive is the host's own (its apt sources file), so a host
# with a mirror builds from the mirror; the host's extra CA certificates go in too, so pip and apt
# inside a build trust what the host trusts (a TLS-inspecting proxy).
set -eu

TAG=${TAG:-tandem-base:bookworm}
SUITE=${SUITE:-bookworm}
if [ -z "${SOURCES:-}" ]; then
	for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
		if [ -s "$f" ]; then SOURCES=$f && break; fi
	done
fi
SOURCES=${SOURCES:-http://deb.debian.org/debian}

command -v mmdebstrap >/dev/null || apt-get install -y -q mmdebstrap
# One hook per extra CA certificate (the positional parameters: `set --` collects them).
set --
for ca in /usr/local/share/ca-certificates/*.crt; do
	if [ -f "$ca" ]; then set -- "$@" "--customize-hook=copy-in $ca /usr/local/share/ca-certificates/"; fi
done
start=$(date +%s)
mmdebstrap --variant=minbase --mode=root --format=tar \
	--include=python3,python3-dev,python3-pip,python3-venv,ca-certificates,wget \
	"$@" \
	--customize-hook='chroot "$1" update-ca-certificates' \
	--customize-hook='rm -f "$1"/usr/lib/python3.*/EXTERNALLY-MANAGED' \
	--customize-hook='ln -sf python3 "$1"/usr/bin/python' \
	--customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
	"$SUITE" - "$SOURCES" | docker import \
	-c 'ENV LANG=C.UTF-8' \
	-c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	-c 'CMD ["python3"]' \
	- "$TAG"
echo "$TAG in $(($(date +%s) - start)) s: $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1 / 1e6}')"
