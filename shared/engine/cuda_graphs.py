"""DecodeGraphs: decode steps replayed from CUDA graphs, one captured per batch size.

A decode step of a small model on a GPU is mostly launch overhead: per layer a dozen kernels of
a few microseconds each, every one issued from Python. Captured once in a CUDA graph, a step is
one launch. A graph replays fixed shapes at fixed addresses, so each size in `SIZES` gets one,
over static input buffers: a step of `n` decode rows copies its token ids, positions, KV slots,
block tables and attention ranges into the buffers and replays the smallest graph of at least `n`
rows. Its padding rows compute a token at position 0 of an empty table, write their keys and
values into the pool's scratch block (which no sequence is given), and are dropped.

Only steps where every row is a decode row (one token, attention through the paged kernel) are
replayed; anything else (prompt chunks, a table wider than the graphs' or more rows than the
largest graph) runs eagerly, and a model whose rotary embedding depends on the sequence length
gets no graphs at all (`decode_graphs`). `capture=False` computes the same static-buffer step
without a graph (how the CPU tests check the padding and the buffers).
"""

import logging

import torch

from shared.engine.forward_batch import ForwardBatch, SeqSpan

log = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphs:
    def __init__(self, runner, max_tokens: int, sizes=SIZES, capture: bool = True):
        self.runner = runner
        self.sizes = sorted(sizes)
        pool, n, device = runner.pool, self.sizes[-1], runner.device
        self.block_size = pool.block_size
        self.width = -(-max_tokens // self.block_size)  # block table entries per row
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), pool.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        # (row, position of its token, 1 row): the decode kernel's ranges
        self.ranges = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)], 1)
        self.ranges = torch.cat([self.ranges, torch.ones(n, 1, dtype=torch.long)], 1).to(device)
        self.last_rows = torch.arange(n, device=device)
        pinned = device != "cpu"
        self.host = torch.zeros(3, n, dtype=torch.long, pin_memory=pinned)  # ids, positions, slots
        self.host_tables = torch.zeros(n, self.width, dtype=torch.int32, pin_memory=pinned)
        self.graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, torch.Tensor]
        ] = {}  # size: graph, logits
        if capture:
            self._capture_all()

    def fits(self, segments: list[SeqSpan]) -> bool:
        return 0 < len(segments) <= self.sizes[-1] and all(
            s.end - s.start == 1 and not s.prompt and s.end <= self.width * self.block_size
            for s in segments
        )

    @torch.inference_mode()
    def run(self, segments: list[SeqSpan]) -> torch.Tensor:
        """Logits [len(segments), vocab] of a step of decode rows (see `fits`)."""
        rows = len(segments)
        size = next(s for s in self.sizes if s >= rows)
        self._load(segments, size)
        graph, logits = self.graphs.get(size, (None, None))
        if graph is None:
            logits = self._step(size)
        else:
            graph.replay()
        return logits[:rows].clone()  # the graph's output buffer is overwritten by the next step

    def _load(self, segments: list[SeqSpan], size: int) -> None:
        """The step's rows into the static buffers; rows past them (up to `size`) pad: token 0 at
        position 0, its KV into the scratch slot, its attention over block 0's first key."""
        rows, bs, scratch = len(segments), self.block_size, self.runner.pool.scratch_slot
        pad = size - rows
        ids = [s.token_ids[s.start] for s in segments] + [0] * pad
        positions = [s.start for s in segments] + [0] * pad
        slots = [s.block_table[s.start // bs] * bs + s.start % bs for s in segments]
        self.host[:, :size] = torch.tensor([ids, positions, slots + [scratch] * pad])
        tables = [s.block_table[: -(-s.end // bs)] for s in segments]
        widest = max(len(t) for t in tables)
        tables = [t + [0] * (widest - len(t)) for t in tables] + [[0] * widest] * pad
        self.host_tables[:size, :widest] = torch.tensor(tables, dtype=torch.int32)
        # Pinned, these copies are asynchronous: the host buffers are not written again before
        # the step's logits are read (the next step begins after its sampling).
        self.ids[:size].copy_(self.host[0, :size], non_blocking=True)
        self.positions[:size].copy_(self.host[1, :size], non_blocking=True)
        self.slots[:size].copy_(self.host[2, :size], non_blocking=True)
        self.ranges[:size, 1].copy_(self.positions[:size])
        self.tables[:size, :widest].copy_(self.host_tables[:size, :widest], non_blocking=True)

    def _batch(self, size: int) -> ForwardBatch:
        decode = (self.tables[:size], self.ranges[:size], 1)
        return ForwardBatch(
            self.ids[:size],
            self.positions[:size],
            self.slots[:size],
            None,
            [],
            decode,
            None,
            self.last_rows[:size],
            [(1, 0)] * size,  # read only by a length-dependent rotary embedding: never here
        )

    def _step(self, size: int) -> torch.Tensor:
        return self.runner.compute(self._batch(size))

    def _capture_all(self) -> None:
        """Largest first, all in one memory pool: each graph's activations reuse the last's."""
        device = torch.device(self.runner.device)  # cuda:N: its streams, not the current device's
        with torch.cuda.device(device):
            memory = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.inference_mode():
            for size in reversed(self.sizes):
                self._step(size)  # compiles the Triton kernels, settles cuBLAS's workspace
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory, stream=stream):
                    logits = self._step(size)
                self.graphs[size] = (graph, logits)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)


def decode_graphs(runner) -> DecodeGraphs | None:
    """The runner's decode graphs, captured now; None where its rotary embedding depends on the
    sequence length (recomputed per step) or CUDA refuses the capture (the steps run eagerly)."""
    if runner.rotary.length_dependent:
        return None
    try:
        return DecodeGraphs(runner, runner.config.max_position_embeddings)
    except RuntimeError as error:
        log.warning("decode steps run eagerly: CUDA graph capture failed: %s", error)
        return None
