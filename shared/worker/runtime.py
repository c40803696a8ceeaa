"""Start-up of a model worker: the model, tokenizer, KV block budget and identity, loaded once."""

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared import model_store
from shared.control.failure import Code, Failure, failed
from shared.control.rules import MAX_LABEL
from shared.control.worker_roles import Role
from shared.engine import kernels as cpu_kernels
from shared.engine.architecture import check
from shared.engine.block_manager import BlockManager
from shared.engine.dtypes import compute_dtype
from shared.engine.engine import Engine
from shared.engine.file_pages import allocations_given_back, convertible
from shared.engine.kv_cache import KVPool, bytes_per_token, layout_of
from shared.engine.model_runner import ModelRunner
from shared.grammar.compiler import BadConstraint, GrammarCompiler
from shared.grammar.state import GrammarState
from shared.values.kv_layout import KVLayout
from shared.worker.end_tokens import eos_token_ids
from shared.worker.metrics import WorkerMetrics
from shared.worker.settings import WorkerSettings
from shared.worker.tp_group import TPGroup, start_group

log = logging.getLogger(__name__)
STOP_RANKS_S = 10.0  # for the other ranks of a group to leave when told, before they are killed


@dataclass
class WorkerRuntime:
    worker_id: str
    role: Role
    host: str
    runner: ModelRunner
    tokenizer: object
    blocks: BlockManager
    engine: Engine
    max_model_len: int
    eos_token_ids: set[int]
    summary_limit: int = 1024
    max_queue: int = 0
    kernels: str = ""  # KernelReport.line() of the runner
    model_label: str = ""  # "name · architecture · dtype"
    metrics: WorkerMetrics = None  # its Prometheus metrics (served with --metrics-port)
    group: TPGroup | None = None  # the other ranks of a tensor-parallel worker
    grammars: GrammarCompiler | None = None  # made at the first constrained request (~0.5 s)
    _grammars_made: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = WorkerMetrics(self.role, self.worker_id)
        self.engine.stats.observer = self.metrics.on_step

    @property
    def layout(self) -> KVLayout:
        """The KV layout peers pair with: the whole model's, whatever this worker's degree."""
        return self.group.layout if self.group is not None else self.runner.layout

    @property
    def pools(self) -> list[KVPool]:
        """Each rank's KV pool, rank 0 first (one without tensor parallelism)."""
        return self.group.pools if self.group is not None else [self.runner.pool]

    @property
    def tp(self) -> int:
        return self.group.spec.tp if self.group is not None else 1

    def mask_of(self, task) -> GrammarState | None:
        """The state of the task's constraint (structured output), after the output it resumes
        from (a moved request's); None without one. BadConstraint when it cannot compile (the
        gateway refuses those: a client that skips it gets INVALID_ARGUMENT from here)."""
        constraint = task.sampling.constraint
        if constraint is None:
            return None
        with self._grammars_made:  # compiled on threads (constrained): one compiler
            if self.grammars is None:
                self.grammars = self._grammar_compiler()
        ids = task.prompt_token_ids
        return self.grammars.state(constraint, ids[len(ids) - task.resume_tokens :])

    def _grammar_compiler(self) -> GrammarCompiler:
        # a step's masks on one thread where the forward pass computes on the CPU (a second one
        # contends with the pass's threads: slower, bench/results/structured-outputs.md), on the
        # idle torch threads where it computes on a GPU
        threads = 1 if self.runner.device == "cpu" else torch.get_num_threads()
        return GrammarCompiler(self.tokenizer, self.eos_token_ids, threads)

    def close(self) -> None:
        """The other ranks leave (a tensor-parallel worker's)."""
        if self.group is not None:
            self.group.stop(STOP_RANKS_S)

    def load_report(self) -> dict:
        """The heartbeat fields every model worker reports the same way: capacity, prompt work
        queued, measured prompt speed, a summary of its prefix cache (for routing), and the kernels
        its engine runs."""
        with self.engine.lock:
            summary = self.blocks.prefix_summary(self.summary_limit)
        return dict(
            kv_blocks_used=self.blocks.used,
            kv_blocks_total=self.blocks.num_blocks,
            block_size=self.blocks.block_size,
            max_num_seqs=self.engine.scheduler.max_num_seqs,
            max_queue=self.max_queue,
            prefill_tokens_queued=self.engine.prompt_tokens_queued(),
            prefill_tokens_per_s=round(self.engine.prefill_tokens_per_s, 1),
            decode_step_ms=round(self.engine.decode_step_s * 1000, 1),
            prefix_granularity=self.blocks.granularity,
            prefix_summary=summary,
            kernels=self.kernels,
            tp=self.tp,
            tp_ranks=self.group.describe() if self.group is not None else [],
            model=self.model_label,
        )


def pick_device(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def load_runtime(settings: WorkerSettings, role: Role) -> WorkerRuntime:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    device = pick_device(settings.device)
    model_dir = model_store.prepare(settings.model, settings.model_cache)
    config = model_store.load_config(model_dir)
    check(config)  # an architecture or option the engine does not run: refused before loading
    dtype = compute_dtype(settings.dtype, config, device, _row_kernel(settings, device))
    group, runner = _load_runner(settings, model_dir, config, device, dtype, role)
    step_runner = group.runner if group is not None else runner
    tokenizer = model_store.load_tokenizer(model_dir)
    model_limit = model_store.context_limit(config)
    max_len = min(settings.max_model_len or model_limit, model_limit)
    blocks = BlockManager(
        runner.pool.num_blocks,
        settings.block_size,
        cache_granularity=settings.prefill_chunk_tokens,
        cacheable_tokens=runner.rotary.cacheable_tokens,
    )
    engine = Engine(step_runner, blocks, settings.max_num_seqs, settings.max_batch_tokens)
    eos_ids = eos_token_ids(runner.model.generation_config, tokenizer)
    runtime = WorkerRuntime(
        settings.resolved_worker_id(role),
        role,
        settings.resolved_host(),
        runner,
        tokenizer,
        blocks,
        engine,
        max_len,
        eos_ids,
        settings.prefix_summary_limit,
        settings.max_queue,
        runner.kernel_report().line()[:MAX_LABEL],  # the heartbeat carries it
        model_label(runner),
        group=group,
    )
    _log_ready(runtime, settings, device)
    return runtime


def _load_runner(
    settings: WorkerSettings, model_dir: Path, config, device: str, dtype, role: Role
) -> tuple[TPGroup | None, ModelRunner]:
    """The model loaded into its runner; with --tp, its group too (rank 0's runner)."""
    if settings.tp > 1:
        timing = row_timing_path(settings)
        return start_group(settings, model_dir, config, device, dtype, timing)
    with allocations_given_back():
        model = load_model(model_dir, device, dtype, settings.weights, config)
        return None, _runner(settings, model, device, dtype, decodes=role != Role.PREFILL)


def _row_kernel(settings: WorkerSettings, device: str) -> bool:
    """Whether Tandem's row kernel will compute the linear layers (native weights, its C++
    kernels on and built here)."""
    return (
        device == "cpu"
        and settings.kernels == "auto"
        and settings.weights == "native"
        and cpu_kernels.load() is not None
    )


def _runner(
    settings: WorkerSettings, model, device: str, dtype: torch.dtype, decodes: bool
) -> ModelRunner:
    """The model runner over a KV pool of --kv-cache-mb, computing in `dtype`; the model's own
    linear weights freed as they are packed. `decodes`: it computes decode steps (a prefill
    worker's does not: no CUDA graphs captured for it)."""
    layout = layout_of(
        model.config, model_store.model_name(settings.model), dtype, settings.block_size
    )
    num_blocks = max(
        1, settings.kv_cache_mb * 2**20 // (settings.block_size * bytes_per_token(layout))
    )
    runner = ModelRunner(
        model,
        layout.model,
        device,
        num_blocks,
        settings.block_size,
        settings.prefill_chunk_tokens,
        settings.batch_invariant,
        use_kernels=settings.kernels == "auto",
        row_timing=row_timing_path(settings),
        shared_pool=settings.kv_plane == "helper" and device == "cpu",
        release_weights=True,
        dtype=dtype,
        cuda_graphs=settings.cuda_graphs and decodes,
    )
    return runner


def row_timing_path(settings: WorkerSettings) -> Path:
    """Where the timed row count is kept: row_timing_file, or beside the converted models."""
    default = Path(settings.model_cache) / "row-timing.json"
    return Path(settings.row_timing_file or default).expanduser()


def load_model(model_dir: Path, device: str, dtype: torch.dtype, weights: str, config):
    """The model in `dtype`, or in the checkpoint's own dtype (memory-mapped, read lazily) where
    it is saved in another: the model runner converts it a parameter at a time as it packs
    (file_pages.convert), so that loading peaks near the converted weights alone, not those
    plus the checkpoint's."""
    saved = getattr(config, "dtype", None)
    saved = getattr(torch, str(saved).removeprefix("torch."), None) if saved else None
    if (
        device == "cpu"
        and weights == "native"
        and isinstance(saved, torch.dtype)
        and saved != dtype
    ):
        model = model_store.load_model(model_dir, device, saved, weights, config)
        if convertible(model):
            return model
        log.info("converting at load: a buffer of the model depends on its dtype")
    return model_store.load_model(model_dir, device, dtype, weights, config)


def model_label(runner: ModelRunner) -> str:
    layout = runner.layout
    return " · ".join(
        (layout.model, layout.architecture or type(runner.model).__name__, layout.dtype)
    )


def _log_ready(runtime: WorkerRuntime, settings: WorkerSettings, device: str) -> None:
    blocks = runtime.blocks
    log.info(
        "%s %s (pid %d) ready: model %s on %s/%s, %d threads, %d KV blocks of %d tokens, "
        "max_model_len %d; kernels: %s",
        runtime.role,
        runtime.worker_id,
        os.getpid(),
        runtime.runner.layout.model,
        device,
        str(runtime.runner.dtype).removeprefix("torch."),
        torch.get_num_threads(),
        blocks.num_blocks,
        blocks.block_size,
        runtime.max_model_len,
        runtime.kernels,
    )


async def constrained(runtime: WorkerRuntime, task) -> tuple[GrammarState | None, Failure | None]:
    """The task's constraint state (runtime.mask_of), or the INVALID_ARGUMENT failure that
    refuses a task whose constraint cannot compile. Made on a thread: a schema not compiled here
    before (and the first one's tokenizer, ~0.5 s) would hold up the worker's event loop, its
    heartbeats and every stream; a caller checks what may have changed meanwhile."""
    if task.sampling.constraint is None:
        return None, None
    try:
        return await asyncio.to_thread(runtime.mask_of, task), None
    except BadConstraint as err:
        return None, failed(Code.INVALID_ARGUMENT, str(err), runtime.worker_id)
