"""ForwardBatch: where every row of one forward pass comes from and what its attention reads.

The model runner computes a batch of sequence spans as one block of rows. Before the pass it
arranges the batch: token ids, positions and the pool slots each row's KV is written to; the
query ranges (prompt chunks aligned to absolute `chunk` boundaries, so a prompt is computed
the same way whatever else is in the batch); the single rows that go to the paged decode
kernel; the spans of several rows that go to the prefill kernel (when there is one: then they
are not cut into ranges at all); and the row whose logits each span wants (every row of a span
whose prompt logprobs are asked for is scored as well).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.kv_cache import KVPool
from shared.engine.prompt_scores import PromptScores


@dataclass
class SeqSpan:
    """Positions [start, end) of one sequence computed in this pass (its span of the batch)."""

    block_table: list[int]
    token_ids: Sequence[int]  # the sequence's, prompt and output (a list or a TokenIds view)
    start: int
    end: int
    prompt: bool = False  # prompt rows: the prefill kernel even for a single row (see `arrange`)
    scores: PromptScores | None = None  # every row's scores wanted too (prompt logprobs)


@dataclass
class QueryRange:
    """Query rows [row_start, row_end) attend to keys [ctx_start, ctx_end) of the layer's gather."""

    row_start: int
    row_end: int
    ctx_start: int
    ctx_end: int
    mask: torch.Tensor | None  # causal within the range; None for a single query row

    def mask_within(self, window: int | None, device) -> torch.Tensor | None:
        """The mask of a sliding-window layer: each row also sees only its last `window` keys."""
        keys = self.ctx_end - self.ctx_start
        if window is None or keys <= window:
            return self.mask
        rows = self.row_end - self.row_start
        mask = torch.ones(rows, keys, dtype=torch.bool, device=device)
        return mask.tril(keys - rows).triu(keys - rows - window + 1)


@dataclass
class ForwardBatch:
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor  # where each row's KV is written
    context: torch.Tensor | None  # pool rows (KVPool.rows) gathered per layer for the SDPA ranges
    attention: list[QueryRange]  # ranges through scaled_dot_product_attention
    decode: tuple | None  # single-token rows through the paged decode kernel
    prompt: tuple | None  # spans of several rows through the paged prefill kernel
    last_rows: torch.Tensor
    span_lengths: list[tuple[int, int]]  # (rows, sequence length) of each span: rotary tables
    scored: list[tuple[int, SeqSpan]] = field(default_factory=list)  # (first row, span) to score


def query_ranges(span: SeqSpan, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) query ranges of a span: one decode token, or prompt chunks aligned to
    `chunk`."""
    if span.end - span.start == 1:
        return [(span.start, span.end)]
    out, start = [], span.start
    while start < span.end:
        stop = min(span.end, (start // chunk + 1) * chunk)
        out.append((start, stop))
        start = stop
    return out


@dataclass
class _Builder:
    pool: KVPool
    paged: object  # PagedAttention, or None: every range goes through SDPA
    prefill: object  # PrefillAttention, or None: spans of several rows go through SDPA
    chunk: int
    device: str
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    context: list[torch.Tensor] = field(default_factory=list)
    attention: list[QueryRange] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)
    span_lengths: list[tuple[int, int]] = field(default_factory=list)
    scored: list[tuple[int, SeqSpan]] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # of the single rows
    lengths: list[int] = field(default_factory=list)
    single_rows: list[int] = field(default_factory=list)
    prompt_tables: list[list[int]] = field(default_factory=list)  # of the prefill kernel's spans
    prompt_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    row: int = 0
    ctx: int = 0

    def add(self, span: SeqSpan) -> None:
        if span.scores is not None:
            self.scored.append((self.row, span))
        self.ids.extend(span.token_ids[span.start : span.end])
        self.span_lengths.append((span.end - span.start, max(span.end, len(span.token_ids))))
        self.positions.extend(range(span.start, span.end))
        self.slots.extend(self.pool.slot_list(span.block_table, span.start, span.end))
        if self.prefill and (span.prompt or span.end - span.start > 1):
            self._prompt(span)
            return
        gathered = False
        for start, stop in query_ranges(span, self.chunk):
            first = self.row + start - span.start
            if self.paged and stop - start == 1:
                self._single_row(span, stop, first)
                continue
            if not gathered:  # this context, gathered once per layer
                self.context.append(self.pool.rows(self.pool.slots(span.block_table, 0, span.end)))
                gathered = True
            n = stop - start
            mask = self._causal(n, stop)
            self.attention.append(QueryRange(first, first + n, self.ctx, self.ctx + stop, mask))
        self.row += span.end - span.start
        self.ctx += span.end if gathered else 0
        self.last_rows.append(self.row - 1)

    def _prompt(self, span: SeqSpan) -> None:
        self.prompt_tables.append(span.block_table[: -(-span.end // self.pool.block_size)])
        self.prompt_ranges.append((self.row, span.start, span.end - span.start))
        self.row += span.end - span.start
        self.last_rows.append(self.row - 1)

    def _single_row(self, span: SeqSpan, stop: int, row: int) -> None:
        self.tables.append(span.block_table[: -(-stop // self.pool.block_size)])
        self.lengths.append(stop)
        self.single_rows.append(row)

    def _causal(self, n: int, stop: int) -> torch.Tensor | None:
        if n == 1:
            return None
        return torch.ones(n, stop, dtype=torch.bool, device=self.device).tril(stop - n)

    def build(self) -> ForwardBatch:
        decode = (
            self.paged.plan(self.tables, self.lengths, self.single_rows) if self.tables else None
        )
        prompt = (
            self.prefill.plan(self.prompt_tables, self.prompt_ranges)
            if self.prompt_tables
            else None
        )
        return ForwardBatch(
            torch.tensor(self.ids, dtype=torch.long, device=self.device),
            torch.tensor(self.positions, dtype=torch.long, device=self.device),
            torch.tensor(self.slots, dtype=torch.long, device=self.pool.device),
            torch.cat(self.context) if self.context else None,
            self.attention,
            decode,
            prompt,
            torch.tensor(self.last_rows, dtype=torch.long, device=self.device),
            self.span_lengths,
            self.scored,
        )


def arrange(
    spans: list[SeqSpan], pool: KVPool, paged, chunk: int, device: str, prefill=None
) -> ForwardBatch:
    """The rows of one pass over `spans`, arranged.

    Single rows (decode tokens, a prompt's one-token tail) go to the decode kernel when there is
    one; prompt spans, and any of several rows, to the prefill kernel when there is one (a
    prompt row is then computed the same way however the prompt was cut). All the keys the other
    ranges read are gathered once per layer (`context`
    rows): a sequence's context appears once, and its ranges read prefixes of it.
    """
    builder = _Builder(pool, paged, prefill, chunk, device)
    for span in spans:
        builder.add(span)
    return builder.build()
