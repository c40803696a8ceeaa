"""KVLayout: the shape of a worker's KV pool, what both ends of a KV transfer must agree on before
any byte moves. The engine's pool is built to it; the control plane carries it in a PrefillTask."""

from dataclasses import dataclass, field


@dataclass
class KVLayout:
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    architecture: str = ""  # the model class, e.g. Qwen3ForCausalLM
    windows: list[int] = field(default_factory=list)  # each layer's sliding window; 0 = none
    pool_order: str = ""  # "blocks" (shared.engine.kv_cache); "": a worker from before, not paired
