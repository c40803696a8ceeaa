"""Tracing off costs no header; on, the trace context crosses the bus in message headers and the
handler works within it; log lines of a request carry its id (and trace id)."""

import logging

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shared.control.bus import NatsBus
from shared.control.messages import (
    CancelRequest,
    DecodeAssignment,
    GenerateTask,
    Ping,
    SamplingParams,
)
from shared.telemetry import tracing
from shared.telemetry.request_log import RequestLogFilter, request_scope


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert not tracing.start_tracing("x").enabled
    assert NatsBus("nats://127.0.0.1:1", "n")._headers() is None


def test_the_bus_writes_the_current_span_into_headers():
    bus = NatsBus("nats://127.0.0.1:1", "n", tracing=True)
    assert bus._headers() is None  # no span: nothing to carry
    span = TracerProvider().get_tracer("t").start_span("s")
    with tracing.within(trace.set_span_in_context(span)):
        headers = bus._headers()
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert headers["traceparent"].split("-")[1] == trace_id


def test_a_recorded_span_is_a_child_of_its_parent(monkeypatch):
    provider = TracerProvider()
    root = provider.get_tracer("t").start_span("root")
    parent = trace.set_span_in_context(root)
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("t"))  # not the process's provider
    ctx = tracing.record("child", parent, 10.0, 11.5, worker="w")
    child = trace.get_current_span(ctx)
    assert child.get_span_context().trace_id == root.get_span_context().trace_id
    assert child.parent.span_id == root.get_span_context().span_id
    assert (child.start_time, child.end_time) == (10_000_000_000, 11_500_000_000)


def test_tracing_off_records_nothing_and_keeps_the_parent():
    """The process's tracer with no provider set: no span is made, a child hangs on the
    parent it was given (and `child` runs its block without a span)."""
    assert tracing.record("child", None, 10.0, 11.5) is None
    with tracing.child(None, "nothing"):
        assert not trace.get_current_span().get_span_context().is_valid


def test_log_lines_of_a_request_name_it(caplog):
    caplog.handler.addFilter(RequestLogFilter())
    caplog.handler.setFormatter(logging.Formatter("%(message)s%(request)s"))
    log = logging.getLogger("t")
    with caplog.at_level(logging.INFO):
        log.info("outside")
        with request_scope("req-1.abc"):
            log.info("inside")
    assert caplog.handler.format(caplog.records[0]) == "outside"
    assert caplog.handler.format(caplog.records[1]) == "inside [req-1.abc]"


def test_the_request_of_a_message():
    from shared.control.bus import _request_of

    task = GenerateTask("a.2", [1], SamplingParams(), "reply", 0.0)
    assert _request_of(CancelRequest("a.1")) == "a.1"
    assert _request_of(DecodeAssignment(task=task)) == "a.2"  # one that carries the request
    assert _request_of(Ping()) == ""  # about no request
    assert _request_of(object()) == ""
