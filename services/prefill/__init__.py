"""The prefill service: runs prompt forward passes and sends the KV cache to decode workers over UCX."""
