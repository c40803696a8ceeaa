"""Rotary: the cos/sin rows of one forward pass, per sequence.

For most rope types (default, linear, llama3, yarn) the frequencies are fixed and the model's
own rotary module computes every row at once. Two types make them depend on the sequence
length Hugging Face sees in a call: `dynamic` (NTK scaling past the trained length) and
`longrope` (Phi-3's long factors past `original_max_position_embeddings`). HF takes that length
from the batch's largest position, so it would let one sequence's length change another's
result; here each sequence gets the frequencies of its own length: the prompt's length for its
prompt chunks (as HF prefills a prompt in one call), its length so far for a decode token.
"""

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

LENGTH_DEPENDENT = ("dynamic", "longrope")
CACHED = 256  # dynamic rope: frequencies kept for this many lengths past the trained one


class Rotary:
    def __init__(self, module, config):
        self.module = module  # the model's rotary embedding
        self.config = config
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_type = params.get("rope_type", "default")
        self.original = int(
            params.get("original_max_position_embeddings") or config.max_position_embeddings
        )
        self._freqs: dict[int, torch.Tensor] = {}

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in LENGTH_DEPENDENT

    def recomputes_at(self, num_tokens: int) -> bool:
        """Whether a sequence reaching `num_tokens` must be computed again, every key: longrope
        switches to its long factors past the trained length, and HF's Phi-3 then recomputes the
        whole sequence (prepare_inputs_for_generation drops its cache), so the engine does."""
        return self.rope_type == "longrope" and num_tokens == self.original + 1

    @property
    def cacheable_tokens(self) -> int | None:
        """The longest sequence whose KV does not depend on its length (None: any): the prefix
        cache serves only those (see BlockManager)."""
        return self.original if self.length_dependent else None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, lengths: list[tuple[int, int]]):
        """cos, sin [rows, rotary dim] for `positions`; `lengths`: (rows, sequence length) of each
        span in row order (rows past them, padding, take the trained length's frequencies)."""
        if not self.length_dependent:
            cos, sin = self.module(x, positions[None])
            return cos[0], sin[0]
        keys = [self._key(length) for _, length in lengths]
        rows = [count for count, _ in lengths]
        rows.append(positions.numel() - sum(rows))
        keys.append(self._key(0))
        inv = torch.cat([self._inv_freq(key).expand(n, -1) for key, n in zip(keys, rows) if n])
        freqs = positions[:, None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.module.attention_scaling
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    def _key(self, length: int) -> int:
        """Lengths that share frequencies share a key: up to the trained length, all of them."""
        if self.rope_type == "longrope":
            return self.original + 1 if length > self.original else 0
        return length if length > self.original else 0

    def _inv_freq(self, key: int) -> torch.Tensor:
        """The frequencies of `key`, kept for the most recent CACHED keys (dynamic rope has one
        per length: a long-running worker must not keep them all)."""
        if key in self._freqs:
            self._freqs[key] = self._freqs.pop(key)  # most recently used last
            return self._freqs[key]
        if key == 0:
            inv = self.module.original_inv_freq
        else:
            init = ROPE_INIT_FUNCTIONS[self.rope_type]
            inv, _ = init(self.config, self.module.original_inv_freq.device, seq_len=key)
        if len(self._freqs) >= CACHED:
            del self._freqs[next(iter(self._freqs))]
        self._freqs[key] = inv.float()[None]
        return self._freqs[key]
