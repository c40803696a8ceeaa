"""A model worker's Prometheus metrics: what its engine steps take, what its KV transfers take,
the requests it moved, and, read at each scrape from its latest heartbeat, its load, its KV
blocks and its data plane's counters."""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import Metric

from shared.control.messages import WorkerHeartbeat
from shared.telemetry.histogram import Histogram  # observed every step: the cheap one
from shared.telemetry.metrics import (
    BATCH_BUCKETS,
    ID_LABELS,
    LATENCY_BUCKETS,
    ReadAtScrape,
    counter,
    gauge,
)


def _latency(registry: CollectorRegistry, name: str, doc: str, labels: list[str]) -> Histogram:
    return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=registry)


class WorkerMetrics:
    """Kept whether or not they are served (a few counters: no cost worth a switch)."""

    def __init__(self, role: str, worker_id: str):
        self.registry = registry = CollectorRegistry()
        self.ids = {"role": role, "worker": worker_id}
        ids = list(ID_LABELS)
        self.step_seconds = _latency(
            registry,
            "tandem_engine_step_seconds",
            "Wall time of one engine step, by what it ran: prefill, decode or mixed rows",
            ids + ["kind"],
        )
        self.batch_sequences = Histogram(
            "tandem_engine_batch_sequences",
            "Sequences in one engine step",
            ids,
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.kv_transfer_seconds = _latency(
            registry,
            "tandem_kv_transfer_seconds",
            "A prompt's KV transfer, first piece landed to last (decode side)",
            ids,
        )
        self.kv_exposed_seconds = _latency(
            registry,
            "tandem_kv_transfer_exposed_seconds",
            "The part of a KV transfer after its prefill finished: what it adds to TTFT",
            ids,
        )
        self.migrations = Counter(
            "tandem_migrations",
            "Requests moved: in, taken on after another worker failed them; out, failed here and moved on",
            ids + ["direction"],
            registry=registry,
        )

        for direction in ("in", "out"):  # series that read 0, not absent, before the first
            self.migrations.labels(role, worker_id, direction)
        self._steps = {  # each kind's series, looked up once (read 0 before the first)
            kind: self.step_seconds.labels(role, worker_id, kind)
            for kind in ("prefill", "decode", "mixed")
        }
        self._batch = self.batch_sequences.labels(role, worker_id)

    def on_step(self, kind: str, seconds: float, sequences: int) -> None:
        """A step's figures (from the engine thread, the one thread that steps)."""
        self._steps[kind].observe(seconds)
        self._batch.observe(sequences)

    def on_transfer(self, transfer_ms: float, exposed_ms: float) -> None:
        role, worker = self.ids.values()
        self.kv_transfer_seconds.labels(role, worker).observe(transfer_ms / 1000)
        self.kv_exposed_seconds.labels(role, worker).observe(exposed_ms / 1000)

    def migrated(self, direction: str) -> None:
        self.migrations.labels(*self.ids.values(), direction).inc()

    def status_collector(self, latest, hit_tokens, plane_restarts) -> ReadAtScrape:
        """What the worker's latest heartbeat (`latest()`) says, with its prefix-cache hits and
        its data plane's restarts."""
        return ReadAtScrape(lambda: self._status(latest(), hit_tokens(), plane_restarts()))

    def _status(self, beat: WorkerHeartbeat | None, hits: int, restarts: int) -> Iterator[Metric]:
        ids = self.ids
        yield counter(
            "tandem_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            ids,
            hits,
        )
        yield counter(
            "tandem_kv_plane_restarts",
            "Times the KV data plane's helper was replaced",
            ids,
            restarts,
        )
        if beat is not None:
            yield from self._load(beat)
            yield from self._counts(beat)

    def _load(self, beat: WorkerHeartbeat) -> Iterator[Metric]:
        for name, doc, value in (
            ("tandem_running_sequences", "Sequences decoding or prefilling", beat.running),
            ("tandem_queued_sequences", "Requests held waiting to start", beat.queued),
            ("tandem_kv_blocks_used", "KV cache blocks in use", beat.kv_blocks_used),
            ("tandem_kv_blocks_capacity", "KV cache blocks in the pool", beat.kv_blocks_total),
            (
                "tandem_kv_blocks_quarantined",
                "KV blocks held by receives whose peer died mid-transfer",
                beat.kv_blocks_quarantined,
            ),
            (
                "tandem_kv_blocks_leaked",
                "KV blocks held by no live request or transfer (must stay 0)",
                beat.kv_blocks_leaked,
            ),
        ):
            yield gauge(name, doc, self.ids, value)
        info = {"transport": beat.kv_transport or "none", "kernels": beat.kernels}
        yield gauge(
            "tandem_worker_info",
            "The KV transports and kernels in use (value 1)",
            self.ids | info,
            1,
        )

    def _counts(self, beat: WorkerHeartbeat) -> Iterator[Metric]:
        ids = self.ids
        for name, doc, value in (
            ("tandem_requests_served", "Requests that finished here", beat.requests_served),
            (
                "tandem_kv_transfers_failed",
                "UCX sends or receives that did not complete",
                beat.kv_transfers_failed,
            ),
            (
                "tandem_messages_dropped",
                "Control messages received malformed or out of range",
                beat.messages_dropped,
            ),
        ):
            yield counter(name, doc, ids, value)
        moved = counter(
            "tandem_kv_transfer_bytes",
            "KV bytes moved over the data plane",
            ids | {"direction": "sent"},
            beat.kv_bytes_sent,
        )
        moved.add_metric([*ids.values(), "received"], beat.kv_bytes_received)
        yield moved
