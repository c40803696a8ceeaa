#!/bin/sh
# A CA and a NATS server certificate for the compose stack (NATS over TLS): `sh deploy/make-certs.sh`.
# Writes deploy/certs/ (or the directory given): ca.pem (every service trusts it), server.pem and
# server.key (the NATS server's, for the host names nats, localhost and 127.0.0.1), ca.key (keep it
# private, or delete it once the certificates are made). EXTRA_SAN="DNS:a,DNS:b" names more hosts
# (deploy/k8s/make-certs.sh does).
set -eu
dir=${1:-deploy/certs}
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -days 825 -subj /CN=tandem-ca -keyout ca.key -out ca.pem 2>/dev/null
printf 'subjectAltName=DNS:nats,DNS:localhost,IP:127.0.0.1%s\n' "${EXTRA_SAN:+,$EXTRA_SAN}" > san.ext
openssl req -newkey rsa:2048 -nodes -subj /CN=nats -keyout server.key -out server.csr 2>/dev/null
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 -extfile san.ext \
    -out server.pem 2>/dev/null
rm -f server.csr san.ext ca.srl
chmod 600 ca.key server.key
echo "certificates in $dir"
