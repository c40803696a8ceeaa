#!/bin/sh
# A CA and a NATS server certificate for the Kubernetes manifests (deploy/k8s): `sh deploy/k8s/make-certs.sh`.
# Like deploy/make-certs.sh, but the certificate also names the pods of the NATS StatefulSet (its
# routes connect to nats-N.nats-headless and check the name) and the Services' full names in
# NAMESPACE. It serves both ways of a route (no extended key usage: server and client alike).
# Writes DIR (default deploy/k8s/certs): ca.pem, server.pem, server.key, and ca.key (keep it
# private, or delete it once the certificates are made). Usage: make-certs.sh [DIR] [NAMESPACE]
set -eu
dir=${1:-deploy/k8s/certs}
ns=${2:-tandem}
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -days 825 -subj /CN=tandem-ca -keyout ca.key -out ca.pem 2>/dev/null
san="DNS:nats,DNS:nats.$ns,DNS:nats.$ns.svc,DNS:nats.$ns.svc.cluster.local"
san="$san,DNS:*.nats-headless,DNS:*.nats-headless.$ns.svc,DNS:*.nats-headless.$ns.svc.cluster.local"
printf 'subjectAltName=%s,DNS:localhost,IP:127.0.0.1\n' "$san" > san.ext
openssl req -newkey rsa:2048 -nodes -subj /CN=nats -keyout server.key -out server.csr 2>/dev/null
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 -extfile san.ext \
    -out server.pem 2>/dev/null
rm -f server.csr san.ext ca.srl
chmod 600 ca.key server.key
echo "certificates in $dir (namespace $ns)"
