"""ModelRunner: one forward pass over a batch of sequences, reading and writing the paged KV pool.

It runs the checkpoint's Hugging Face modules (embedding, norms, MLP activation, rotary tables)
with its own attention over the pool, so prefill chunks of several prompts and the decode tokens
of every running sequence go through the projections and MLPs as one batch of rows. What differs
between the supported families is named per layer by `architecture.LayerParts`.

Determinism: a sequence's tokens are computed the same way whatever else is in the batch, so a
greedy request gives the same tokens alone or among many. Where Tandem's C++ kernels are built,
every row of every projection goes through the row kernel (`RowLinear`), which computes each row
alone by construction; otherwise GEMMs are row-independent at the row counts measured at start-up
(see `projection.invariant_row_counts`; a tiny batch is padded up to one). Attention runs per
sequence, prompts in fixed `chunk`-token ranges aligned to absolute positions, decode tokens one
at a time.
"""

import logging
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.engine import kernels as cpu_kernels
from shared.engine import kv_cache
from shared.engine.architecture import check, parts_of
from shared.engine.cuda_graphs import decode_graphs
from shared.engine.decode_stack import decode_stack
from shared.engine.file_pages import FilePages, convert
from shared.engine.forward_batch import ForwardBatch, SeqSpan, arrange
from shared.engine.kernel_report import KernelReport, report_of
from shared.engine.kv_cache import KVPool
from shared.engine.layer_ops import layer_ops
from shared.engine.output_head import OutputHead
from shared.engine.paged_attention import PagedAttention
from shared.engine.prefill_attention import PrefillAttention
from shared.engine.projection import SMALL, Projection, invariant_row_counts
from shared.engine.rotary import Rotary
from shared.engine.row_timing import cached_fastest_row_count
from shared.engine.sampler import argmax_rows
from shared.engine.shared_region import SharedRegion
from shared.values.kv_layout import KVLayout

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model,
        model_name: str,
        device: str,
        pool_blocks: int,
        block_size: int,
        chunk: int,
        batch_invariant: bool = True,
        use_kernels: bool = True,
        row_timing: Path | None = None,  # where the fastest row count is kept (row_timing.py)
        shared_pool: bool = False,  # the pool in memory a data-plane helper process maps too
        release_weights: bool = False,  # free each linear weight once packed (see below)
        dtype: torch.dtype | None = None,  # to compute in, if not the model's (converted here)
        triton: bool | None = None,  # Triton attention; None: on CUDA where Triton is installed
        cuda_graphs: bool = True,  # decode steps replayed from CUDA graphs (with Triton on CUDA)
        reduce: Callable[[torch.Tensor], object] | None = None,  # a TP rank: sums o's, down's out
        pool_region: SharedRegion | None = None,  # the pool's memory, made by another process
    ):
        self.model, self.device = model, device
        self.reduce = reduce  # in place, across the group; its layers then run one by one
        self.config, self.dtype = model.config, dtype or model.dtype
        self.family = check(model.config, type(model).__name__)
        self.layout: KVLayout = kv_cache.layout_of(model.config, model_name, self.dtype, block_size)
        graphs = cuda_graphs and device.startswith("cuda") and reduce is None
        pool = (self.layout, pool_blocks, block_size, device, shared_pool, graphs, pool_region)
        self.pool = KVPool(*pool)
        self.chunk = chunk
        inner = model.model
        self.embed, self.norm = inner.embed_tokens, inner.norm
        self.rotary = Rotary(inner.rotary_emb, model.config)
        self.parts = parts_of(model)
        self.num_heads, self.head_dim = model.config.num_attention_heads, self.layout.head_dim
        self.kernels = kernels = cpu_kernels.load() if use_kernels and device == "cpu" else None
        self._fuse_projections(model, release_weights, kernels)
        self.batch_invariant = batch_invariant and device == "cpu"
        # the row kernel in every projection: each row computed alone, at any row count
        probe = self.batch_invariant and not self.row_kernel
        self.row_counts = self._invariant_rows() if probe else []
        self.min_rows = cached_fastest_row_count(
            self.projections, [c for c in self.row_counts if c <= 4], row_timing
        )
        self.graphs = None  # captured below, once the kernels are chosen (they report it)
        triton = self._use_kernels(kernels, triton, use_kernels)
        self.graphs = decode_graphs(self) if graphs and triton else None

    def _use_kernels(self, kernels, triton: bool | None, use_kernels: bool) -> bool:
        """Tandem's C++ kernels where they are built and apply to this family (None: torch);
        `triton`: Triton's attention instead of the C++ one (the elementwise ops stay as they
        are); None: on CUDA where Triton is installed. Returns whether it is Triton's."""
        if triton is None:
            cuda = self.device.startswith("cuda")
            triton = use_kernels and cuda and find_spec("triton") is not None
        self.paged, self.prefill = self._attention(kernels, triton)
        self.ops = layer_ops(kernels, self.model, self.parts)
        per_layer = [
            p for parts in zip(self.qkv, self.o_proj, self.gate_up, self.down) for p in parts
        ]
        shape = (self.num_heads, self.layout.num_kv_heads, self.head_dim)
        paged = None if triton else self.paged  # the C++ stack calls the C++ decode kernel
        self.stack = (
            decode_stack(self.ops, paged, self.parts, self.norm, per_layer, shape)
            if self.reduce is None
            else None  # the C++ stack runs every layer in one call: no all-reduce between them
        )
        if kernels is not None and self.stack is None:
            log.info(
                "%s: decode steps run layer by layer in Python: %s",
                self.family,
                self.kernel_report().line(),
            )
        return triton

    def _attention(self, kernels, triton: bool) -> tuple:
        """(decode, prefill) attention: Triton's, the C++ kernels', or none (SDPA per range)."""
        size, scale = self.pool.block_size, self.head_dim**-0.5
        if triton:
            from shared.engine.triton_attention import TritonPagedAttention, TritonPrefillAttention

            return (
                TritonPagedAttention(size, scale, self.device),
                TritonPrefillAttention(size, scale, self.device),
            )
        if kernels is None:
            return None, None
        return PagedAttention(kernels, size, scale), PrefillAttention(kernels, size, scale)

    def _fuse_projections(self, model, release: bool, kernels) -> None:
        """q|k|v and gate|up fused into one GEMM each, every projection packed where it can be.
        `release`: each module's own weight freed as soon as its packed copy exists (and its
        pages given back when it was read from a mapped file), so that loading peaks near one
        copy of the weights, not two; the model can no longer run on its own afterwards.

        A model in another dtype than `self.dtype` is converted here, after its output head is
        packed (converted on the way) and before the layers are: a tied embedding table then
        stays in the checkpoint's dtype, in its mapped file, read row by row (`_embed`), and
        at no point are both a converted table and the packed head held with the rest."""
        pages = FilePages() if release else None

        def packed(modules, sizes=None) -> Projection:
            projection = Projection(modules, sizes, self.dtype, kernels)
            if release:
                projection.release_modules(keep=self.embed.weight, pages=pages)
            return projection

        weight, bias = model.lm_head.weight, model.lm_head.bias
        self.lm_head = packed([model.lm_head])  # its pages dropped, then read sparsely if at all:
        self.head = OutputHead(self.lm_head, weight, bias)  # rows recomputed in float32
        tied = weight is self.embed.weight
        if release and tied:
            pages.drop(weight)  # tied: the lookup faults back in only the rows it reads
        if any(p.dtype != self.dtype for p in model.parameters() if p.numel()):
            convert(model, self.dtype, keep=weight if tied and _copied(self.lm_head) else None)
        self.qkv, self.o_proj, self.gate_up, self.down = [], [], [], []
        for p in self.parts:
            self.qkv.append(packed(p.qkv, p.qkv_sizes))
            self.o_proj.append(packed([p.o_proj]))
            self.gate_up.append(packed(p.gate_up, p.gate_up_sizes))
            self.down.append(packed([p.down]))
        self.projections = [*self.qkv, *self.o_proj, *self.gate_up, *self.down, self.lm_head]
        self.row_kernel = all(p.rows is not None for p in self.projections)

    def _invariant_rows(self) -> list[int]:
        probe = [self.qkv[0], self.o_proj[0], self.gate_up[0], self.down[0], self.lm_head]
        counts = invariant_row_counts(probe)
        if SMALL not in counts:
            log.warning(
                "batch invariance does not hold with these weights (no row count up to %d computes "
                "rows independently: int8 weights quantize activations per call)",
                SMALL,
            )
        return counts

    def kernel_report(self) -> KernelReport:
        """Which kernels this runner computes with (projections, attention, decode stack, ops)."""
        return report_of(self)

    def padded_rows(self, rows: int) -> int:
        """The row count to compute `rows` rows at: one at which every row gets the bits it gets in
        any batch (the smallest >= rows, and for a tiny batch the fastest, see fastest_row_count);
        `rows` itself where the row kernel computes every projection."""
        return next((count for count in self.row_counts if count >= max(rows, self.min_rows)), rows)

    def argmax(self, logits: torch.Tensor) -> list[int]:
        return argmax_rows(logits)

    def copy_block(self, source: int, target: int) -> None:
        self.pool.copy_block(source, target)

    @torch.inference_mode()
    def forward(
        self, segments: list[SeqSpan], abandon: Callable[[], bool] | None = None
    ) -> torch.Tensor | None:
        """Computes the segments; returns logits [len(segments), vocab] at each segment's last row.
        `abandon`, asked between layers, may stop a long step early (None returned): every
        sequence in it was cancelled, and the KV it wrote so far is of no use to anyone."""
        scored = any(s.scores is not None for s in segments)
        if self.graphs is not None and not scored and self.graphs.fits(segments):
            return self.graphs.run(segments)
        batch = arrange(segments, self.pool, self.paged, self.chunk, self.device, self.prefill)
        return self.compute(batch, abandon)

    def compute(
        self, batch: ForwardBatch, abandon: Callable[[], bool] | None = None
    ) -> torch.Tensor | None:
        """`forward` of an arranged batch (a decode graph captures this)."""
        rows = batch.ids.numel()
        hidden = self._embed(batch.ids)
        total = self.padded_rows(rows)
        if total > rows:
            hidden = torch.cat([hidden, hidden.new_zeros(total - rows, hidden.shape[1])])
        positions = torch.cat([batch.positions, batch.positions.new_zeros(total - rows)])
        cos, sin = self.rotary(hidden, positions, batch.span_lengths)
        if (
            self.stack is not None
            and batch.decode is not None
            and batch.prompt is None
            and not batch.attention
        ):
            x = self.stack(
                hidden, cos, sin, self.pool, batch.slots, batch.decode
            )  # all rows decode
            return self._scored(batch, x)
        residual, x = self.ops.norm(hidden, None, self.parts[0].input_norm)
        kv_index = self.ops.kv_index(self.pool, batch.slots)  # once, not per layer
        for index, parts in enumerate(self.parts):
            if abandon is not None and abandon():
                return None
            attended = self._attend(index, x, cos, sin, batch, rows, kv_index)
            if self.reduce is not None:
                self.reduce(attended)
            residual, x = self.ops.norm(residual, attended, parts.post_norm)
            gate, up = self.gate_up[index](x)
            out = self.down[index].one(self.ops.act_mul(parts.act, gate, up))
            if self.reduce is not None:
                self.reduce(out)
            after = self.parts[index + 1].input_norm if index + 1 < len(self.parts) else self.norm
            residual, x = self.ops.norm(residual, out, after)
        return self._scored(batch, x)

    def _scored(self, batch: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
        """The logits of each span's last row, once the spans that want every row's scores
        (prompt logprobs) have them from the same normed rows `x`."""
        for first, span in batch.scored:
            rows = span.end - span.start
            span.scores.add(
                lambda a, b, f=first: self._logits(x[f + a : f + b]),
                span.start,
                rows,
                span.token_ids,
            )
        return self._logits(x.index_select(0, batch.last_rows))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids`, in the dtype computed in (a table kept in another dtype
        is read as the converted one would be: upcast rows, Gemma's scale applied after)."""
        if self.embed.weight.dtype == self.dtype:
            return self.embed(ids)
        hidden = F.embedding(ids, self.embed.weight).to(self.dtype)
        scale = getattr(self.embed, "embed_scale", None)
        return hidden * scale if scale is not None else hidden

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        rows = normed.shape[0]
        total = rows if self.lm_head.rows is not None else self.padded_rows(rows)
        if total > rows:
            normed = torch.cat([normed, normed.new_zeros(total - rows, normed.shape[1])])
        return self.head(normed, rows)

    def _attend(self, index: int, x, cos, sin, batch: ForwardBatch, rows: int, kv_index):
        total = x.shape[0]
        q, k, v = self.qkv[index](x)
        q = q.view(total, self.num_heads, self.head_dim)
        k = k.view(total, self.layout.num_kv_heads, self.head_dim)
        v = v.view(total, self.layout.num_kv_heads, self.head_dim)
        parts = self.parts[index]
        if parts.q_norm is not None:  # Qwen3: each head normalized before the rotary embedding
            q, k = parts.q_norm(q), parts.k_norm(k)
        q, k = self.ops.rope(q, k, cos, sin)
        self.ops.store(self.pool, index, kv_index, k, v)
        out = (
            q.new_zeros(total, self.num_heads, self.head_dim)
            if total > rows
            else torch.empty_like(q)
        )
        keys, values = self.pool.layers[index]
        if batch.decode is not None:
            self.paged(q, keys, values, batch.decode, out, parts.window)
        if batch.prompt is not None:
            self.prefill(q, keys, values, batch.prompt, out, parts.window)
        if batch.attention:
            self._attend_ranges(index, q, batch, out, parts.window)
        return self.o_proj[index].one(out.view(total, -1))

    def _attend_ranges(
        self, index: int, q: torch.Tensor, batch: ForwardBatch, out: torch.Tensor, window
    ) -> None:
        """Prompt chunks (and, without the kernel, decode rows): one SDPA call per range."""
        # [1, heads, context positions, dim]
        keys, values = (t.transpose(0, 1)[None] for t in self.pool.read(index, batch.context))
        q = q.transpose(0, 1)[None]
        for a in batch.attention:
            attended = F.scaled_dot_product_attention(
                q[:, :, a.row_start : a.row_end],
                keys[:, :, a.ctx_start : a.ctx_end],
                values[:, :, a.ctx_start : a.ctx_end],
                attn_mask=a.mask_within(window, q.device),
                enable_gqa=True,
            )
            out[a.row_start : a.row_end] = attended[0].transpose(0, 1)


def _copied(projection: Projection) -> bool:
    """Whether the projection computes from copies of its own (packed or row panels)."""
    return projection.packed is not None or projection.rows is not None
