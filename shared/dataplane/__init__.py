"""The KV data plane: UCX between worker memories, the transfer plan, the sender and receiver.
Control messages carry only its descriptors (addresses, tags, block ids)."""
