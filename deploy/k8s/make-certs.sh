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
san="DNS:nats.$ns,DNS:nats.$ns.svc,DNS:nats.$ns.svc.cluster.local"
san="$san,DNS:*.nats-headless,DNS:*.nats-headless.$ns.svc,DNS:*.nats-headless.$ns.svc.cluster.local"
EXTRA_SAN=$san sh "$(dirname "$0")/../make-certs.sh" "$dir"
echo "(namespace $ns)"
