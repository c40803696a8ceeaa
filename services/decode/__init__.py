"""The decode service: receives KV over UCX (or prefills locally when colocated) and streams tokens."""
