"""The engine: per-request state, KV accounting, the model runner, sampling and detokenization."""
