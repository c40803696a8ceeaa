"""Router: which prefill and decode worker serve a request. Later issues add cache and topology terms."""

from dataclasses import dataclass

from shared.messages import GenerateTask, WorkerHeartbeat
from services.scheduler.registry import WorkerRegistry


class NoWorker(Exception):
    """No live worker of a needed role can take the request."""

    code = "UNAVAILABLE"


class NoRoom(NoWorker):
    """Workers are alive, but none has room for the request now."""

    code = "RESOURCE_EXHAUSTED"


@dataclass
class Route:
    decode: WorkerHeartbeat
    prefill: WorkerHeartbeat | None   # None: prefill on the decode worker


def _fits(worker: WorkerHeartbeat, task: GenerateTask) -> bool:
    tokens = len(task.prompt_token_ids) + task.sampling.max_tokens
    if tokens > worker.max_model_len or worker.kv_blocks_total == 0:
        return False
    return -(-tokens // max(1, worker.block_size)) <= worker.kv_blocks_total - worker.kv_blocks_used


def _decode_load(worker: WorkerHeartbeat) -> tuple:
    # Fill the pool evenly: fewest sequences first, then most free KV.
    return (worker.running + worker.queued, worker.kv_blocks_used - worker.kv_blocks_total, worker.worker_id)


def _prefill_load(worker: WorkerHeartbeat) -> tuple:
    return (worker.queued + worker.running, worker.worker_id)


def route(registry: WorkerRegistry, mode: str, task: GenerateTask, exclude: set[str] = frozenset()) -> Route:
    decode_role = "colocated" if mode == "colocated" else "decode"
    decoders = [w for w in registry.live(decode_role) if w.worker_id not in exclude]
    if not decoders:
        raise NoWorker(f"no live {decode_role} worker")
    fitting = [w for w in decoders if _fits(w, task)]
    if not fitting:
        raise NoRoom(f"no {decode_role} worker has room for {len(task.prompt_token_ids)} prompt "
                       f"+ {task.sampling.max_tokens} new tokens")
    decode = min(fitting, key=_decode_load)
    if mode == "colocated":
        return Route(decode=decode, prefill=None)
    prefills = [w for w in registry.live("prefill") if w.worker_id not in exclude and w.layout == decode.layout]
    if not prefills:
        raise NoWorker("no live prefill worker" + (" with a matching KV layout" if registry.live("prefill") else ""))
    return Route(decode=decode, prefill=min(prefills, key=_prefill_load))
