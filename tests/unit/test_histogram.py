"""The cheap histogram is exposed as prometheus_client's own is, observation for observation."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as ClientHistogram

from shared.telemetry.histogram import Histogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)
# on a bound (le counts it there), between, under the first, past the last, 0
AMOUNTS = (0.0005, 0.001, 0.002, 0.01, 0.5, 1.0, 3.0, 100.0, 0.0)


def exposed(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if "_created" not in line]


def test_exposed_as_prometheus_clients_histogram():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = Histogram("t_seconds", "doc", ["api", "role"], buckets=BUCKETS, registry=ours)
    client = ClientHistogram("t_seconds", "doc", ["api", "role"], buckets=BUCKETS, registry=theirs)
    for i, amount in enumerate(AMOUNTS):
        labels = ("http" if i % 2 else "grpc", "gateway")
        mine.labels(*labels).observe(amount)
        client.labels(*labels).observe(amount)
    assert exposed(ours) == exposed(theirs)
    assert ours.get_sample_value(
        "t_seconds_bucket", {"api": "grpc", "role": "gateway", "le": "0.001"}
    ) == theirs.get_sample_value(
        "t_seconds_bucket", {"api": "grpc", "role": "gateway", "le": "0.001"}
    )


def test_a_series_is_its_labels_and_the_count_is_right():
    registry = CollectorRegistry()
    histogram = Histogram("x_seconds", "doc", ["a"], buckets=BUCKETS, registry=registry)
    assert histogram.labels("1") is histogram.labels(1)  # label values are strings
    with pytest.raises(ValueError):
        histogram.labels("1", "2")
    histogram.labels("1").observe(0.5)
    assert registry.get_sample_value("x_seconds_count", {"a": "1"}) == 1
    assert registry.get_sample_value("x_seconds_sum", {"a": "1"}) == 0.5
    with pytest.raises(ValueError):  # a second metric of the name: refused, as the client does
        Histogram("x_seconds", "doc", ["a"], buckets=BUCKETS, registry=registry)
