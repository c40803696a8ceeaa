"""What a worker can hold, as its heartbeat tells: the router's filters, pure functions."""

from shared.control.messages import GenerateTask, WorkerHeartbeat


def needed_blocks(worker: WorkerHeartbeat, task: GenerateTask, cached: int) -> int:
    """The prompt's blocks, and each choice's output's (n > 1: forked, the prompt shared)."""
    tokens = len(task.prompt_token_ids) + task.sampling.n * task.sampling.max_tokens
    bs = max(1, worker.block_size)
    return -(-tokens // bs) - cached // bs


def could_ever_fit(worker: WorkerHeartbeat, task: GenerateTask) -> bool:
    tokens = len(task.prompt_token_ids) + task.sampling.max_tokens
    return tokens <= worker.max_model_len and holds(worker, tokens)


def fill_after(worker: WorkerHeartbeat, blocks: int) -> float:
    """How full the worker would be with this sequence: the fuller of its batch and its KV pool."""
    seqs = worker.running + worker.queued + 1
    batch = seqs / worker.max_num_seqs if worker.max_num_seqs else 0.0
    return max(batch, (worker.kv_blocks_used + blocks) / max(1, worker.kv_blocks_total))


def holds(worker: WorkerHeartbeat, tokens: int) -> bool:
    """The worker's whole KV cache holds `tokens`."""
    return -(-tokens // max(1, worker.block_size)) <= worker.kv_blocks_total


def takes(prefill: WorkerHeartbeat, prompt_len: int) -> bool:
    """The prefill worker would accept the prompt now: its KV budget holds it and its queue has a place."""
    full = prefill.max_queue and prefill.running + prefill.queued >= prefill.max_queue
    return holds(prefill, prompt_len) and not full
