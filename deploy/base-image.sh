#!/bin/sh
# A base image for the Dockerfile made from Debian's packages, for a host that reaches Debian's
# archive and PyPI but no container registry (run as root):
#   sh deploy/base-image.sh                     # -> tandem-base:bookworm
#   docker build --build-arg BASE=tandem-base:bookworm -t tandem:latest .
# It stands in for python:3.11-slim: Debian 12's Python 3.11 with pip and its headers (the CPU
# kernels build against them), `python` on the path, pip allowed to install into the system Python.
set -eu

TAG=${TAG:-tandem-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WORK=${WORK:-$(mktemp -d)}
ROOTFS=$WORK/rootfs

command -v debootstrap >/dev/null || apt-get install -y debootstrap
if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
	debootstrap --variant=minbase --include=python3,python3-dev,python3-pip,python3-venv,ca-certificates \
		bookworm "$ROOTFS" "$MIRROR"
fi

# A host behind a TLS-inspecting proxy trusts its CA; the image must too (pip uses this store).
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
	cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
	chroot "$ROOTFS" update-ca-certificates
fi
rm -f "$ROOTFS/usr/lib/python3.11/EXTERNALLY-MANAGED"
ln -sf python3 "$ROOTFS/usr/bin/python"
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin

tar -C "$ROOTFS" -c . | docker import \
	-c 'ENV LANG=C.UTF-8' \
	-c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	-c 'CMD ["python3"]' \
	- "$TAG"
echo "$TAG: $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1 / 1e6}')"
