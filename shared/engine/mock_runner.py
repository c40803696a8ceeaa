"""MockRunner: a ModelRunner that does not compute (`--engine mock`), for measuring the control
plane at scale without a model per worker.

Everything around the forward pass is the real one: the Engine schedules and batches, the
BlockManager and its prefix cache account every block, sequences are admitted, cancelled,
preempted and moved as in a real worker, and the KV pool is a real tensor whose bytes the data
plane moves over UCX. Only `forward` differs: it waits as long as the real engine would take
for the step (a TimingModel fitted from the real engine's profile, divided by `speedup`; 0:
no wait at all) and returns logits that make the next token a fixed function of the token
before it and its position, so a request's answer is the same on every worker, alone or batched,
after a move or a preemption.

The pool holds `kv_bytes_per_token` bytes per token, laid out over the real model's layer count
(one uint8 "head" per layer), so a KV transfer has the real one's pieces; 0 gives 2 bytes per
token in one layer, the least a layout holds (blocks are counted alike: their number comes
from the real model's KV size).
"""

import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from shared.engine.forward_batch import SeqSpan
from shared.engine.kv_cache import POOL_ORDER, KVPool
from shared.engine.sampler import argmax_rows
from shared.engine.timing_model import TimingModel
from shared.values.kv_layout import KVLayout

PICKED = 30.0  # the chosen token's logit; every other is 0 (a sampled draw picks it too)
SLICE_S = 0.01  # a long wait is cut in slices of this, asking `abandon` between them


class _NoRotary:
    """The engine's questions about position encoding, answered as for plain RoPE."""

    cacheable_tokens = None

    @staticmethod
    def recomputes_at(num_tokens: int) -> bool:
        return False


def mock_layout(model: str, num_layers: int, kv_bytes_per_token: int, block_size: int):
    """The pool's layout: `kv_bytes_per_token` (rounded up to 2 x num_layers) over num_layers;
    0: the least a layout holds, one layer of 2 bytes per token (a transfer of next to nothing)."""
    per_half_layer = -(-kv_bytes_per_token // (2 * num_layers))
    return KVLayout(
        model=model,
        dtype="uint8",
        num_layers=num_layers if per_half_layer else 1,
        num_kv_heads=1,
        head_dim=max(per_half_layer, 1),
        block_size=block_size,
        architecture="mock",
        pool_order=POOL_ORDER,
    )


class MockRunner:
    def __init__(
        self,
        layout: KVLayout,
        pool_blocks: int,
        chunk: int,
        vocab: range,  # the ids it may answer with (no special token among them)
        timing: TimingModel,
        speedup: float,
        shared_pool: bool = False,
    ):
        self.layout = layout
        self.pool = KVPool(layout, pool_blocks, layout.block_size, "cpu", shared=shared_pool)
        self.chunk = chunk
        self.vocab = vocab
        self.timing = timing
        self.speedup = speedup
        self.rotary = _NoRotary()
        self.kernels = None  # its rows are masked with torch's ops
        self.device, self.dtype, self.model = "cpu", torch.uint8, None
        self._rows = np.zeros((0, vocab.stop), dtype=np.float32)  # the logits' memory (numpy)
        self._logits = torch.from_numpy(self._rows)  # the same memory, as the engine reads it
        self._picked: np.ndarray | None = None  # where _logits holds PICKED (flat offsets)
        self._tokens: list[int] = []  # the token each row of the last pass picked

    def kernel_report(self) -> "MockReport":
        return MockReport(self.timing.source, self.speedup)

    def copy_block(self, source: int, target: int) -> None:
        """A fork's copy of a part-full block (its pool holds bytes as a real one would)."""
        self.pool.copy_block(source, target)

    def next_token(self, previous: int, position: int) -> int:
        """The token a sequence gets at `position` after `previous`."""
        mixed = (previous * 1_000_003 + position * 7_919) % len(self.vocab)
        return self.vocab.start + mixed

    def step_s(self, segments: list[SeqSpan]) -> float:
        prompts = [(s.start, s.end) for s in segments if s.end - s.start > 1 or s.start == 0]
        decodes = [s.end for s in segments if s.end - s.start == 1 and s.start > 0]
        return self.timing.step_s(prompts, decodes)

    def forward(
        self, segments: list[SeqSpan], abandon: Callable[[], bool] | None = None
    ) -> torch.Tensor | None:
        started = time.perf_counter()
        if self.speedup > 0:
            until = started + self.step_s(segments) / self.speedup
            while (left := until - time.perf_counter()) > 0:
                if abandon is not None and abandon():
                    return None
                time.sleep(min(left, SLICE_S))
        for s in segments:
            if s.scores is not None:
                s.scores.add(partial(self._rows_of, s), s.start, s.end - s.start, s.token_ids)
        return self._pick([self.next_token(s.token_ids[s.end - 1], s.end) for s in segments])

    def _rows_of(self, span: SeqSpan, a: int, b: int) -> torch.Tensor:
        """The logits of the span's rows [a, b), as its last row's are made (prompt scores)."""
        positions = range(span.start + a, span.start + b)
        rows = torch.zeros(b - a, self.vocab.stop)
        picked = [self.next_token(span.token_ids[p], p + 1) for p in positions]
        rows[torch.arange(b - a), torch.tensor(picked)] = PICKED
        return rows

    def _pick(self, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] with each row's token at PICKED, others 0 (one buffer,
        its previous picks cleared: the engine has read them before it steps again). Written
        through numpy: two of torch's indexed writes cost ~90 us a step here, numpy's ~10."""
        rows = len(tokens)
        if self._rows.shape[0] < rows:
            grown = max(rows, 2 * self._rows.shape[0])
            self._rows = np.zeros((grown, self.vocab.stop), dtype=np.float32)
            self._logits = torch.from_numpy(self._rows)
            self._picked = None
        flat, width = self._rows.reshape(-1), self._rows.shape[1]
        if self._picked is not None:
            flat[self._picked] = 0.0
        self._picked = np.arange(rows) * width + np.asarray(tokens, dtype=np.int64)
        flat[self._picked] = PICKED
        self._tokens = tokens
        return self._logits[: len(tokens)]

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """The tokens the last pass picked, when `logits` is what it returned (each row is 0 but
        its pick: the argmax without a scan of 49k columns a row); else argmax_rows'."""
        rows = logits.shape[0]
        if logits.data_ptr() == self._logits.data_ptr() and rows <= len(self._tokens):
            return self._tokens[:rows]
        return argmax_rows(logits)


class MockReport:
    """What a mock worker says it runs with (its heartbeat's kernel line)."""

    def __init__(self, source: str, speedup: float):
        self.source, self.speedup = source, speedup

    def line(self) -> str:
        pace = "no wait" if self.speedup <= 0 else f"speedup {self.speedup:g}"
        return f"mock engine · {pace} · timing of {self.source or 'an unnamed profile'}"[:256]
