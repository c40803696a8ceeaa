"""Start-up of a mock worker (`--engine mock`): the real model's tokenizer, context length, stop
tokens and KV block budget, and a MockRunner in place of the model (see mock_runner)."""

import logging
import os
from dataclasses import dataclass

from shared import model_store
from shared.control.rules import MAX_LABEL
from shared.control.worker_roles import Role
from shared.engine.block_manager import BlockManager
from shared.engine.dtypes import compute_dtype
from shared.engine.engine import Engine
from shared.engine.kv_cache import bytes_per_token, layout_of
from shared.engine.mock_runner import MockRunner, mock_layout
from shared.engine.timing_model import DEFAULT_PATH, TimingModel
from shared.values.kv_layout import KVLayout
from shared.worker.end_tokens import eos_token_ids
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MockModel:
    """What a mock worker takes from the real model: loaded once, shared by a fleet's workers."""

    name: str
    config: object
    tokenizer: object
    generation_config: object
    real_layout: KVLayout

    @classmethod
    def load(cls, settings: WorkerSettings) -> "MockModel":
        model_dir = model_store.prepare(settings.model, settings.model_cache)
        config = model_store.load_config(model_dir)
        name = model_store.model_name(settings.model)
        # the real worker's dtype (its row kernel assumed built: the mock loads no kernels)
        row_kernel = settings.kernels == "auto" and settings.weights == "native"
        dtype = compute_dtype(settings.dtype, config, "cpu", row_kernel)
        return cls(
            name,
            config,
            model_store.load_tokenizer(model_dir),
            generation_config(model_dir),
            layout_of(config, name, dtype, settings.block_size),
        )


def load_mock_runtime(settings: WorkerSettings, role: Role) -> WorkerRuntime:
    return mock_runtime(settings, role, MockModel.load(settings))


def mock_runtime(
    settings: WorkerSettings, role: Role, model: MockModel, quiet: bool = False
) -> WorkerRuntime:
    """A mock worker's runtime (`quiet`: its ready line at debug level, as in a fleet)."""
    real_bytes = bytes_per_token(model.real_layout)
    per_token = settings.mock_kv_bytes_per_token
    per_token = real_bytes if per_token < 0 else per_token
    layout = mock_layout(model.name, model.real_layout.num_layers, per_token, settings.block_size)
    # as many blocks as the real model's KV would have in --kv-cache-mb: the same admissions
    num_blocks = max(1, settings.kv_cache_mb * 2**20 // (settings.block_size * real_bytes))
    runner = MockRunner(
        layout,
        num_blocks,
        settings.prefill_chunk_tokens,
        answer_ids(model.tokenizer, model.config),
        TimingModel.load(settings.mock_timing or DEFAULT_PATH),
        settings.mock_speedup,
        shared_pool=settings.kv_plane == "helper",
    )
    blocks = BlockManager(
        num_blocks, settings.block_size, cache_granularity=settings.prefill_chunk_tokens
    )
    engine = Engine(runner, blocks, settings.max_num_seqs, settings.max_batch_tokens)
    limit = model_store.context_limit(model.config)
    held = bytes_per_token(layout)
    runtime = WorkerRuntime(
        settings.resolved_worker_id(role),
        role,
        settings.resolved_host(),
        runner,
        model.tokenizer,
        blocks,
        engine,
        min(settings.max_model_len or limit, limit),
        eos_token_ids(model.generation_config, model.tokenizer),
        settings.prefix_summary_limit,
        settings.max_queue,
        runner.kernel_report().line()[:MAX_LABEL],  # the heartbeat carries it
        f"{model.name} · mock · {held} KV bytes/token",
    )
    log.log(logging.DEBUG if quiet else logging.INFO, "%s", ready_line(runtime, model))
    return runtime


def ready_line(runtime: WorkerRuntime, model: MockModel) -> str:
    blocks = runtime.blocks
    return (
        f"{runtime.role} {runtime.worker_id} (pid {os.getpid()}) ready: mock engine for "
        f"{model.name}, {blocks.num_blocks} KV blocks of {blocks.block_size} tokens; "
        f"{runtime.kernels}"
    )


def answer_ids(tokenizer, config) -> range:
    """The ids a mock answers with: past every special token, within the vocabulary."""
    size = min(config.vocab_size, len(tokenizer))
    return range(max(tokenizer.all_special_ids, default=-1) + 1, size)


def generation_config(model_dir):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # the checkpoint has none: the tokenizer's EOS ends generation
        return None
