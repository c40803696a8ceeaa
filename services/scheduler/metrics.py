"""The scheduler's Prometheus metrics: its queue by priority, the workers it knows by pool,
whether it takes submissions (Intake) and how often it stood aside, where it placed requests and
why it refused others, how long routing took, and each time a disaggregated request fell back to
its decode worker's prefill (logged too)."""

import collections
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.admission import Pending
from services.scheduler.router import Route
from shared.control.failure import Code
from shared.control.messages import WorkerHeartbeat
from shared.control.worker_roles import Role
from shared.telemetry import tracing
from shared.telemetry.metrics import ID_LABELS, LATENCY_BUCKETS

log = logging.getLogger(__name__)


class SchedulerMetrics:
    def __init__(self, scheduler_id: str):
        self.registry = registry = CollectorRegistry()
        self.ids = ("scheduler", scheduler_id)
        ids = list(ID_LABELS)
        self.queue_depth = Gauge(
            "tandem_scheduler_queue_depth",
            "Requests waiting here for room, by priority",
            ids + ["priority"],
            registry=registry,
        )
        self.live_workers = Gauge(
            "tandem_scheduler_live_workers",
            "Workers whose heartbeats this scheduler hears, by pool (prefill, decode, colocated)",
            ids + ["pool"],
            registry=registry,
        )
        self.placements = Counter(
            "tandem_scheduler_placements",
            "Requests placed, by path (disaggregated: a prefill worker and a decode worker; local)",
            ids + ["path"],
            registry=registry,
        )
        self.refusals = Counter(
            "tandem_scheduler_refusals",
            "Submissions answered with a failure, by its code",
            ids + ["reason"],
            registry=registry,
        )
        self.prefill_fallbacks = Counter(
            "tandem_scheduler_prefill_fallbacks",
            "Disaggregated requests prefilled on their decode worker: no prefill worker was live",
            ids,
            registry=registry,
        )
        self.routing_seconds = Histogram(
            "tandem_scheduler_routing_seconds",
            "Time to choose the workers for one request",
            ids,
            buckets=(1e-5, 3e-5, 1e-4, 3e-4) + LATENCY_BUCKETS,
            registry=registry,
        )
        self._intake_series(ids)
        self._read_zero_until_used()
        self._priorities = {"0"}  # the default priority reads 0 while nothing waits

    def _intake_series(self, ids: list[str]) -> None:
        """Whether the replica takes submissions (Intake), and how often it stood aside."""
        self.accepting = Gauge(
            "tandem_scheduler_accepting",
            "1 while this replica takes new submissions (in the queue group); 0 while it stands "
            "aside: it knows no live worker that could serve a request",
            ids,
            registry=self.registry,
        )
        self.stood_aside = Counter(
            "tandem_scheduler_stood_aside",
            "Times this replica stood aside (left the queue group): it knew no live worker that "
            "could serve a request",
            ids,
            registry=self.registry,
        )

    def _read_zero_until_used(self) -> None:
        """The series that read 0, not absent, before their first event."""
        for path in ("local", "disaggregated"):
            self.placements.labels(*self.ids, path)
        for code in Code:
            self.refusals.labels(*self.ids, code.value.lower())
        self.prefill_fallbacks.labels(*self.ids)
        self.accepting.labels(*self.ids).set(0)  # a replica starts aside (Intake)
        self.stood_aside.labels(*self.ids)

    def tick(self, priorities: list[int], workers: list[WorkerHeartbeat]) -> None:
        """The queue's and the registry's state now (the scheduler's tick, on its event loop)."""
        depth = collections.Counter(str(p) for p in priorities)
        for priority in self._priorities | set(depth):  # a priority emptied reads 0
            self.queue_depth.labels(*self.ids, priority).set(depth[priority])
        self._priorities |= set(depth)
        pools = collections.Counter(w.role for w in workers)
        for pool in Role:
            self.live_workers.labels(*self.ids, pool).set(pools[pool])

    def routed(self, entry: Pending, started: float, chosen: Route) -> None:
        """Routing that began at `started` (perf_counter) placed `entry`: its time, the request's
        queue and route spans (the route's is where its trace goes on from), and a prefill
        fallback, counted and logged."""
        route_s = time.perf_counter() - started
        self.routing_seconds.labels(*self.ids).observe(route_s)
        routed = tracing.now()
        waited = time.monotonic() - entry.enqueued_at - route_s
        tracing.record("scheduler.queue", entry.trace, routed - route_s - waited, routed - route_s)
        entry.trace = tracing.record(
            "scheduler.route",
            entry.trace,
            routed - route_s,
            routed,
            decode_worker=chosen.decode.worker_id,
            prefill_worker=chosen.prefill.worker_id if chosen.prefill else "",
        )
        if chosen.fallback:
            self.prefill_fallbacks.labels(*self.ids).inc()
            log.warning(
                "no live prefill worker: %s (%d prompt tokens to compute) is prefilled on decode "
                "worker %s (prefill_fallback=local)",
                entry.task.attempt_id,
                chosen.compute_tokens,
                chosen.decode.worker_id,
            )

    def intake(self, accepting: bool, missing: str) -> None:
        """The replica joined the queue group (True), or stood aside (False) for lack of
        `missing`: counted and logged."""
        self.accepting.labels(*self.ids).set(int(accepting))
        if accepting:
            log.info("%s takes submissions: it hears a worker that could serve them", self.ids[1])
        else:
            self.stood_aside.labels(*self.ids).inc()
            log.warning("%s stood aside (left the queue group): %s", self.ids[1], missing)

    def placed(self, disaggregated: bool) -> None:
        self.placements.labels(*self.ids, "disaggregated" if disaggregated else "local").inc()

    def refused(self, code: str) -> None:
        self.refusals.labels(*self.ids, code.lower()).inc()
