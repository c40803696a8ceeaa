"""Transports: the NATS control-plane bus and the UCX KV data plane, each with a test fake."""
