"""The gateway's Prometheus metrics: every request it ended, by API, status and path, and the
latencies and token counts clients saw (time to first token, inter-token latency, end to end,
queue time)."""

import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily

from services.gateway.direct_rooms import DirectRooms
from shared.api import tandem_pb2 as pb
from shared.telemetry.histogram import Histogram  # observed for each answer: the cheap one
from shared.telemetry.metrics import ID_LABELS, LATENCY_BUCKETS

WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.5)


class GatewayMetrics:
    def __init__(self, gateway_id: str):
        self.registry = registry = CollectorRegistry()
        self.ids = ("gateway", gateway_id)
        api = [*ID_LABELS, "api"]
        self.requests = Counter(
            "tandem_requests",
            "Requests ended, by API, gRPC status (ok, or the error's) and path (local, "
            "disaggregated, migrated; none when no token came)",
            api + ["status", "path"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "tandem_requests_in_flight", "Requests open now", api, registry=registry
        )
        self.latency = {
            name: Histogram(
                f"tandem_{name}_seconds", doc, api, buckets=LATENCY_BUCKETS, registry=registry
            )
            for name, doc in (
                ("time_to_first_token", "Arrival at the gateway to the first token leaving it"),
                ("inter_token_latency", "Gap between successive tokens of a stream"),
                (
                    "request_duration",
                    "Arrival at the gateway to the last token (requests that finished)",
                ),
                (
                    "request_queue",
                    "Arrival at the gateway to its prefill starting (workers' timing)",
                ),
            )
        }
        self.tokens = {
            kind: Counter(f"tandem_{kind}_tokens", doc, api, registry=registry)
            for kind, doc in (
                ("prompt", "Prompt tokens of requests that finished"),
                ("generation", "Tokens generated and sent"),
                ("cached_prompt", "Prompt tokens served from a prefix cache"),
            )
        }

        self.token_wait = _token_wait(registry).labels(*self.ids)
        self._series: dict[str, _Series] = {}  # by API: its children, looked up once

    def series(self, api: str) -> "_Series":
        """The API's series (a child's lookup in prometheus_client takes a lock and builds its
        key: ~4 us each, nine a request)."""
        found = self._series.get(api)
        if found is None:
            found = self._series[api] = _Series(self, (*self.ids, api))
        return found

    def count_rooms(self, rooms: DirectRooms) -> None:
        """Requests this gateway placed on a worker itself, and those the worker turned away
        (read from `rooms` at each scrape)."""
        self.registry.register(_RoomCounts(rooms, self.ids))

    def waited(self, arrived: float | None) -> None:
        """An answer goes out now whose first chunk arrived at `arrived` (None: not known)."""
        if arrived is not None:
            self.token_wait.observe(time.monotonic() - arrived)

    def request(self, api: str) -> "RequestObserver":
        return RequestObserver(self, api)


def _token_wait(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "tandem_gateway_token_wait_seconds",
        "A token's time in the gateway: its chunk's arrival from the worker to its answer "
        "going to the client (what the gateway adds to the inter-token latency)",
        ID_LABELS,
        buckets=WAIT_BUCKETS,
        registry=registry,
    )


class _Series:
    """One API's children of the gateway's metrics."""

    def __init__(self, m: GatewayMetrics, labels: tuple[str, ...]):
        self.m, self.labels = m, labels
        self.in_flight = m.in_flight.labels(*labels)
        latency = {name: h.labels(*labels) for name, h in m.latency.items()}
        self.ttft, self.itl = latency["time_to_first_token"], latency["inter_token_latency"]
        self.duration, self.queue = latency["request_duration"], latency["request_queue"]
        tokens = {kind: c.labels(*labels) for kind, c in m.tokens.items()}
        self.generation, self.prompt = tokens["generation"], tokens["prompt"]
        self.cached_prompt = tokens["cached_prompt"]
        self._ended: dict[tuple[str, str], object] = {}  # (status, path): a handful of each

    def ended(self, status: str, path: str):
        """The requests counter's child for `status` and `path`."""
        found = self._ended.get((status, path))
        if found is None:
            found = self._ended[status, path] = self.m.requests.labels(*self.labels, status, path)
        return found


class RequestObserver:
    """One request's figures as its responses go out; `end` counts it once."""

    def __init__(self, metrics: GatewayMetrics, api: str):
        self.s = metrics.series(api)
        self.arrival = time.monotonic()
        self.last_token_at: dict[int, float] = {}  # of each choice
        self.last: pb.GenerateResponse | None = None  # the first choice's last response
        self.path = "none"
        self.s.in_flight.inc()

    def on_response(self, response: pb.GenerateResponse) -> None:
        now, s = time.monotonic(), self.s
        if response.token_ids:
            last = self.last_token_at.get(response.index)
            if not self.last_token_at:
                s.ttft.observe(now - self.arrival)
            elif last is not None:
                s.itl.observe(now - last)
            self.last_token_at[response.index] = now
            s.generation.inc(len(response.token_ids))
        if response.finish_reason:  # of one choice: the request's figures count once, at the end
            migrated = response.timing.migrations or self.path == "migrated"
            self.path = "migrated" if migrated else (response.timing.path or "none")
            self.last = self.last or response

    def end(self, code: grpc.StatusCode | None, finished: bool) -> None:
        """`code`: the status the call was ended with (None: none); `finished`: the last
        response went out (else the client went away)."""
        status = code.name.lower() if code is not None else ("ok" if finished else "cancelled")
        s, last = self.s, self.last
        if finished and last is not None:
            s.duration.observe(time.monotonic() - self.arrival)
            s.queue.observe(last.timing.queue_ms / 1000)
            s.prompt.inc(last.usage.prompt_tokens)
            s.cached_prompt.inc(last.timing.cached_tokens)
        s.ended(status, self.path).inc()
        s.in_flight.dec()


class RecordingContext:
    """A call context that remembers the status the request path ended the call with; the rest
    of what the request path asks of a context (HttpCallContext's methods) is the wrapped one's."""

    def __init__(self, context):
        self._context = context
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self):
        return self._context.invocation_metadata()

    def auth_context(self) -> dict:
        return self._context.auth_context()

    def peer(self) -> str:
        return self._context.peer()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def set_trailing_metadata(self, metadata) -> None:
        self._context.set_trailing_metadata(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code = code
        await self._context.abort(code, details)


class _RoomCounts:
    """DirectRooms' counts as Prometheus counters."""

    def __init__(self, rooms: DirectRooms, ids: tuple[str, str]):
        self.rooms, self.ids = rooms, ids

    def collect(self):
        for name, doc, value in (
            (
                "tandem_gateway_direct_placed",
                "Requests this gateway placed on a worker a scheduler named as having room",
                self.rooms.placed,
            ),
            (
                "tandem_gateway_direct_turned_away",
                "Of those, requests a worker did not take (the decode worker, or its prefill worker: then placed by a scheduler)",
                self.rooms.turned,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=ID_LABELS)
            family.add_metric(list(self.ids), value)
            yield family
