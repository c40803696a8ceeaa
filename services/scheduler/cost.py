"""The scheduler's cost model: how long a request would wait on each path, in seconds.

    remote path (prefill worker p, decode worker d):
        cost = (p's queued prompt tokens + prompt tokens p must compute x (1 + L / 4096)) / p's prompt speed
             + KV bytes to move / bandwidth(p, d)
    local path (prefilled on decode worker d):
        cost = (d's queued prompt tokens + prompt tokens d must compute x (1 + L / 4096)) / d's prompt speed
        (L the prompt's length) and, when auto mode weighs it against a busy prefill pool, that times (1 + the sequences
        decoding on d): each of them stalls while the prompt computes (the prefill tax)

"Tokens to compute" is the prompt minus what the worker's prefix cache already holds, estimated
from the cache summary in its heartbeats (the prefix credit). "KV bytes to move" is the part of
the prompt the decode worker does not hold, times the layout's bytes per token. The bandwidth is
set by topology: the same host moves KV through shared memory, the same zone (rack) over one
switch, anything else across the network. These are planning figures, not measurements: they
only need to rank choices, and they make a same-host pair win whenever prefill waits are near
equal, while a much shorter queue elsewhere still wins over a long one next door.
"""

from dataclasses import dataclass, field

from shared.control.messages import KVLayout, WorkerHeartbeat
from shared.values.prefix_hash import granule_keys

SAME_HOST_BYTES_PER_S = 8e9  # UCX over shared memory / cma: 5-9 GB/s measured (bench/results/kv.md)
SAME_ZONE_BYTES_PER_S = 1.25e9  # one 10 GbE hop
CROSS_ZONE_BYTES_PER_S = 0.3e9  # across racks or zones: shared, oversubscribed links
UNMEASURED_TOKENS_PER_S = 1000.0  # a worker's prompt speed before it has measured its own
# The prompt length at which attention doubles a prompt token's cost; the measured speed comes
# mostly from shorter prompts. On the CPU engine, 2,048-token prompts run at 0.69x the speed of
# 512-token ones (bench/results/engine.md) and 4,096-token ones at about half.
ATTENTION_TOKENS = 4096

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(layout: KVLayout) -> int:
    return (
        layout.num_layers
        * 2
        * layout.num_kv_heads
        * layout.head_dim
        * DTYPE_BYTES.get(layout.dtype, 4)
    )


def bandwidth(a: WorkerHeartbeat, b: WorkerHeartbeat) -> float:
    if a.host == b.host:
        return SAME_HOST_BYTES_PER_S
    if a.zone and a.zone == b.zone:
        return SAME_ZONE_BYTES_PER_S
    return CROSS_ZONE_BYTES_PER_S


def prompt_speed(worker: WorkerHeartbeat) -> float:
    return (
        worker.prefill_tokens_per_s if worker.prefill_tokens_per_s > 0 else UNMEASURED_TOKENS_PER_S
    )


@dataclass
class PromptView:
    """One request's prompt, with its prefix-cache keys computed once per cache geometry."""

    token_ids: list[int]
    _keys: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def cached_tokens(self, worker: WorkerHeartbeat, summary: frozenset[int]) -> int:
        """Prompt tokens the worker's prefix cache would serve (whole granules from the start)."""
        g = worker.prefix_granularity
        if g <= 0 or not summary or worker.block_size <= 0 or g % worker.block_size:
            return 0
        geometry = (worker.block_size, g)
        if geometry not in self._keys:
            self._keys[geometry] = granule_keys(self.token_ids, worker.block_size, g)
        hits = 0
        for key in self._keys[geometry]:
            if key not in summary:
                break
            hits += 1
        return hits * g


def prefill_wait_s(worker: WorkerHeartbeat, tokens_to_compute: int, prompt_len: int = 0) -> float:
    """Until the worker has computed this prompt: the prompt work queued ahead of it, then its own,
    which costs more per token the longer the prompt (attention reads the whole context)."""
    own = tokens_to_compute * (1 + prompt_len / ATTENTION_TOKENS)
    return (worker.prefill_tokens_queued + own) / prompt_speed(worker)


def local_prefill_cost_s(route) -> float:
    """What prefilling on the decode worker costs in all: this request's own wait, plus the stall
    it imposes on each sequence decoding there (their next tokens wait behind the prompt's
    chunks: the prefill tax). A remote prefill stalls nobody, so it is compared with this."""
    return route.cost_s * (1 + route.decode.running)


def transfer_s(prefill: WorkerHeartbeat, decode: WorkerHeartbeat, tokens: int) -> float:
    return tokens * kv_bytes_per_token(decode.layout) / bandwidth(prefill, decode)
