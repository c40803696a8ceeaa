"""Prometheus metrics: each service keeps its own registry and serves it on its own port.

Names follow Prometheus' conventions: `tandem_*`, base units (`_seconds`, `_bytes`), counters
ending in `_total`; every series is labelled with the service's role and its id (`worker`),
never with a request id. The server is prometheus-client's own (a thread), so a scrape is
answered even while the service's event loop is busy.
"""

import logging
import socket
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# 1 ms to 60 s: TTFT, inter-token latency, queue time, end-to-end time, transfer time
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ID_LABELS = ("role", "worker")
# metrics_host: the address this machine's own name resolves to. In a container or a pod that is
# its address on the container or pod network: scrapers there reach it, and nothing is bound on
# every interface (where a host network or a second interface would expose it too).
OWN_ADDRESS = "@hostname"


def bind_address(host: str) -> str:
    """Where to listen for `host`: itself, or for OWN_ADDRESS this host name's address."""
    if host != OWN_ADDRESS:
        return host
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as err:
        raise ValueError(
            f"metrics_host {OWN_ADDRESS}: the host name {name!r} does not resolve ({err})"
        ) from None


class MetricsServer:
    """Serves `registry` at http://host:port/metrics while entered (port -1: not at all; 0: any
    free port, found in `.port` once entered)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry, self.host, self.port = registry, host, port
        self._server = self._thread = None

    def __enter__(self) -> "MetricsServer":
        if self.port >= 0:
            self.host = bind_address(self.host)
            self._server, self._thread = start_http_server(self.port, self.host, self.registry)
            self.port = self._server.server_port
            log.info("Prometheus metrics on http://%s:%d/metrics", self.host, self.port)
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)


def gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    """A counter read from a count kept elsewhere (`name` without `_total`)."""
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class ReadAtScrape(Collector):
    """Metrics read when Prometheus scrapes: `read()` yields them from the service's state."""

    def __init__(self, read: Callable[[], Iterable[Metric]]):
        self._read = read

    def collect(self) -> Iterable[Metric]:
        try:
            yield from self._read()
        except Exception:  # a scrape must never take the service down
            log.exception("reading metrics failed")
