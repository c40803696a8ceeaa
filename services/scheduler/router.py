"""Router: which decode worker holds a request, and where its prompt is computed.

1. Decode: among workers that can hold the whole sequence now (KV blocks after their own prefix
   hit, a batch slot, and, with `max_itl_ms` set, a measured decode step time under it: more
   sequences there would slow every token past the target), the emptiest by max(batch fill,
   KV fill) after placing it, so the pool fills evenly. Workers within `decode_slack` of the
   emptiest count as equal; of those, the emptiest NEAR_PRICED and every one with a prefix hit
   go on to be priced (an idle pool of a thousand costs no more than one of 32).
2. Prefill: every (prefill worker, near-equal decode worker) pair is priced by the cost model
   (services.scheduler.cost): queued prompt work plus this prompt's uncached part, at the
   worker's measured speed, plus moving the KV at the pair's topology bandwidth. A prefill
   worker whose queue is full, or whose KV budget cannot hold the prompt, is not a candidate.
3. Mode: `disaggregated` prefills on a prefill worker; when none is live at all (the lost last
   one excluded), `prefill_fallback` decides: prefill on the decode worker (local, the default),
   wait in the scheduler's queue for one (wait), or fail (fail). `colocated` always prefills on
   the decode worker; `auto` prefills locally when what is left after the decode worker's prefix
   cache is at most `local_prefill_tokens`, when no prefill worker is live, or when the prefill
   pool's best wait exceeds `prefill_busy_s` and the local path costs less, counting the stall a
   local prefill imposes on every sequence decoding there (cost.local_prefill_cost_s).
A path whose prefill worker has more than `max_prefill_wait_s` of prompt work queued ahead has no
room: the request waits in the scheduler's queue (or is refused) instead of queueing without end
on a worker. (Its own compute does not count: an idle worker always has room.)
"""

from dataclasses import dataclass, replace

from services.scheduler import capacity, cost
from services.scheduler.cost import PromptView
from services.scheduler.registry import WorkerRegistry
from services.scheduler.roles import decode_roles
from shared.control.failure import Code, Failure, failed
from shared.control.messages import GenerateTask, WorkerHeartbeat
from shared.control.worker_roles import Mode, Role

NEAR_PRICED = 32  # near-equal decode workers priced per request, besides those with a prefix hit


class NoWorker(Exception):
    """No live worker of a needed role: the request cannot be served now."""

    code = Code.UNAVAILABLE
    retry_later = True  # trying again later may succeed (a refusal says when: retry-after)

    @property
    def failure(self) -> Failure:
        """The request's failure when it cannot wait for room."""
        return failed(self.code, str(self))


class TooLarge(NoWorker):
    """No live worker could ever hold the request: retrying will not help."""

    code = Code.RESOURCE_EXHAUSTED
    retry_later = False


class NoRoom(NoWorker):
    """Workers are alive, but none has room now: the request may wait for room."""

    code = Code.RESOURCE_EXHAUSTED


@dataclass
class Policy:
    mode: Mode = Mode.AUTO
    local_prefill_tokens: int = 256
    prefill_busy_s: float = 30.0
    max_prefill_wait_s: float = 60.0
    decode_slack: float = 0.05
    max_itl_ms: float = 0.0  # 0 = no latency bound, only memory and batch slots
    prefill_fallback: str = "local"  # disaggregated, no live prefill worker: local, wait or fail


@dataclass
class Route:
    decode: WorkerHeartbeat
    prefill: WorkerHeartbeat | None  # None: prefill on the decode worker
    decode_cached: int = 0  # prompt tokens the decode worker's prefix cache holds
    blocks: int = 0  # KV blocks the sequence takes on the decode worker
    compute_tokens: int = 0  # prompt tokens the chosen prefill computes
    cost_s: float = 0.0  # the cost model's estimate (see cost.py)
    queued_s: float = 0.0  # of which: waiting behind prompt work already queued there
    fallback: bool = False  # disaggregated, but prefilled here: no prefill worker was live


class Router:
    def __init__(self, registry: WorkerRegistry, policy: Policy):
        self.registry = registry
        self.policy = policy

    def route(self, task: GenerateTask, exclude: set[str] = frozenset()) -> Route:
        prompt = PromptView(task.prompt_token_ids)
        decoders = self._decoders(task, exclude)
        near = self._near_equal(decoders, task, prompt)
        if self.policy.mode == Mode.COLOCATED:
            return self._local_best(near, prompt)
        remote = self._remote_best(near, prompt, exclude)
        if self.policy.mode == Mode.DISAGGREGATED:
            return self._checked(remote or self._no_prefill(near, prompt, exclude))
        local = self._local_best(near, prompt)
        return self._auto(local, remote)

    # -- decode -------------------------------------------------------------------------------

    def _decoders(self, task: GenerateTask, exclude: set[str]) -> list[WorkerHeartbeat]:
        roles = decode_roles(self.policy.mode)
        decoders = [
            w for w in self.registry.live() if w.role in roles and w.worker_id not in exclude
        ]
        if not decoders:
            raise NoWorker(f"no live {' or '.join(roles)} worker")
        if not any(capacity.could_ever_fit(w, task) for w in decoders):
            raise TooLarge(
                f"{len(task.prompt_token_ids)} prompt + {task.sampling.max_tokens} new tokens "
                f"do not fit any worker's context or KV cache"
            )
        return decoders

    def _near_equal(
        self, decoders: list[WorkerHeartbeat], task: GenerateTask, prompt: PromptView
    ) -> list[tuple[WorkerHeartbeat, int, int]]:
        """(worker, cached tokens, blocks needed) of the workers with room, emptiest first."""
        room = []
        for w in decoders:
            cached = prompt.cached_tokens(w, self.registry.summary(w.worker_id))
            blocks = capacity.needed_blocks(w, task, cached)
            held = w.running + w.queued
            slots = (not w.max_num_seqs or held < w.max_num_seqs) and (
                not w.max_queue or held < w.max_queue
            )
            if (
                capacity.could_ever_fit(w, task)
                and slots
                and not self._too_slow(w)
                and blocks <= w.kv_blocks_total - w.kv_blocks_used
            ):
                room.append((capacity.fill_after(w, blocks), w.worker_id, w, cached, blocks))
        if not room:
            raise NoRoom(
                "every decode worker's batch or KV cache is full"
                + (
                    f", or its tokens slower than {self.policy.max_itl_ms:.0f} ms"
                    if self.policy.max_itl_ms
                    else ""
                )
            )
        room.sort(key=lambda r: r[:2])
        best = room[0][0]
        near = [
            (w, cached, blocks)
            for fill, _, w, cached, blocks in room
            if fill <= best + self.policy.decode_slack
        ]
        # priced (with every prefill worker) are the emptiest NEAR_PRICED and each prefix hit
        return near[:NEAR_PRICED] + [e for e in near[NEAR_PRICED:] if e[1] > 0]

    def _too_slow(self, w: WorkerHeartbeat) -> bool:
        """The worker's tokens will come slower than the ITL target once the sequences already
        placed there but not decoding yet (prompts, KV in flight, placed since its heartbeat) join:
        its measured step time, scaled by the batch they make. An idle worker never is (its last
        measurement is of a batch that has gone)."""
        if not (self.policy.max_itl_ms and w.running):
            return False
        return w.decode_step_ms * (w.running + w.queued) / w.running > self.policy.max_itl_ms

    # -- prefill ------------------------------------------------------------------------------

    def _local_best(self, near, prompt: PromptView) -> Route:
        def local(entry) -> Route:
            w, cached, blocks = entry
            compute = len(prompt.token_ids) - cached
            return Route(
                w,
                None,
                cached,
                blocks,
                compute,
                cost.prefill_wait_s(w, compute, len(prompt.token_ids)),
                cost.prefill_wait_s(w, 0),
            )

        return min(
            enumerate(local(e) for e in near), key=lambda ir: (round(ir[1].cost_s, 3), ir[0])
        )[1]

    def _remote_best(self, near, prompt: PromptView, exclude: set[str]) -> Route | None:
        """The cheapest pair; on equal cost (to the millisecond) the emptier decode worker, as
        `near` is ordered."""
        prefills = [
            p
            for p in self.registry.live(Role.PREFILL)
            if p.worker_id not in exclude and capacity.takes(p, len(prompt.token_ids))
        ]
        best, best_key = None, None
        for rank, (w, cached, blocks) in enumerate(near):
            for p in prefills:
                if p.layout != w.layout:
                    continue
                compute = len(prompt.token_ids) - prompt.cached_tokens(
                    p, self.registry.summary(p.worker_id)
                )
                moved = len(prompt.token_ids) - cached
                total = cost.prefill_wait_s(p, compute, len(prompt.token_ids)) + cost.transfer_s(
                    p, w, moved
                )
                key = (round(total, 3), rank, p.worker_id)
                if best_key is None or key < best_key:
                    best, best_key = (
                        Route(w, p, cached, blocks, compute, total, cost.prefill_wait_s(p, 0)),
                        key,
                    )
        return best

    def _checked(self, route: Route) -> Route:
        if route.queued_s > self.policy.max_prefill_wait_s:
            raise NoRoom(
                f"the prompt work queued ahead ({route.queued_s:.0f}s) is over "
                f"{self.policy.max_prefill_wait_s:.0f}s"
            )
        return route

    def _auto(self, local: Route, remote: Route | None) -> Route:
        if local.compute_tokens <= self.policy.local_prefill_tokens or remote is None:
            return self._checked(local)
        if (
            remote.cost_s > self.policy.prefill_busy_s
            and cost.local_prefill_cost_s(local) < remote.cost_s
        ):
            return self._checked(local)
        return self._checked(remote)

    def _no_prefill(self, near, prompt: PromptView, exclude: set[str]) -> Route:
        """Disaggregated, and no prefill worker takes the prompt. None live: `_fallback`. Else
        raises why: none with the decode pool's KV layout (NoWorker), none whose KV budget holds
        it (TooLarge), or every queue full (NoRoom)."""
        prefills = [p for p in self.registry.live(Role.PREFILL) if p.worker_id not in exclude]
        if not prefills:
            return self._fallback(near, prompt)
        decodes = self.registry.live(Role.DECODE)
        if not any(p.layout == w.layout for p in prefills for w in decodes):
            raise NoWorker(
                "no live prefill worker with a matching KV layout: decode serves "
                f"{_served(decodes)}, prefill serves {_served(prefills)}"
            )
        if not any(capacity.holds(p, len(prompt.token_ids)) for p in prefills):
            raise TooLarge(
                f"a {len(prompt.token_ids)}-token prompt does not fit any prefill worker's KV cache"
            )
        raise NoRoom("every prefill worker's queue is full")

    def _fallback(self, near, prompt: PromptView) -> Route:
        """No prefill worker is live: the decode worker prefills the prompt (local), it waits for
        one in the scheduler's queue (wait), or fails (fail). Just after a start or an outage it
        waits either way: the prefill workers' heartbeats may be on their way."""
        if self.policy.prefill_fallback == "fail":
            raise NoWorker("no live prefill worker")
        if self.policy.prefill_fallback == "wait" or self.registry.settling():
            raise NoRoom("no live prefill worker: the request waits for one")
        return replace(self._local_best(near, prompt), fallback=True)


def _served(workers: list[WorkerHeartbeat]) -> str:
    """The models and KV layouts of `workers`, e.g. "Qwen3-0.6B (Qwen3ForCausalLM, bfloat16,
    28 layers x 8 KV heads x 128)"."""
    return " or ".join(
        sorted(
            {
                f"{w.layout.model} ({w.layout.architecture or '?'}, {w.layout.dtype}, "
                f"{w.layout.num_layers} layers x {w.layout.num_kv_heads} KV heads x "
                f"{w.layout.head_dim}, block {w.layout.block_size})"
                for w in workers
            }
        )
    )
