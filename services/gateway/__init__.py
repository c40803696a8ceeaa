"""The gateway: the gRPC API in front of the cluster."""
