"""OpenTelemetry traces: one trace per request, across the services.

Off unless an OTLP endpoint is given (--otlp-endpoint, or the standard
OTEL_EXPORTER_OTLP_ENDPOINT): then each service exports its spans over OTLP/HTTP, and the bus
carries the trace context in NATS message headers (W3C traceparent). Off, no span is made and no
header is written: the API's no-op tracer costs a function call.

Spans of work that runs away from the message that started it (a prompt computed in the engine
loop, a request waiting in a queue) are recorded when it ends, from the times the service keeps
anyway, under the context saved when the message came (`record`).
"""

import contextlib
import logging
import os
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context

log = logging.getLogger(__name__)
EXPORT_DELAY_MS = 1000  # spans wait at most this long in a service before they are sent


class Tracing:
    """The service's tracing: `enabled`, and `shutdown()` to send what is left."""

    def __init__(self, provider=None):
        self.provider = provider
        self.enabled = provider is not None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def start_tracing(service: str, endpoint: str = "") -> Tracing:
    """Traces exported to `endpoint` (else OTEL_EXPORTER_OTLP_ENDPOINT; neither: off)."""
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if not endpoint:
        return Tracing()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    trace.set_tracer_provider(provider)
    log.info("tracing on: spans to %s/v1/traces", endpoint.rstrip("/"))
    return Tracing(provider)


_TRACER = trace.get_tracer("tandem")  # a proxy: the provider start_tracing sets, once set


def tracer() -> trace.Tracer:
    """The services' tracer. OpenTelemetry's proxy tracer follows the provider set later (its
    documented module-level use); asking `get_tracer` each time read the environment and made a
    proxy per call (~5 us, five times a request on the gateway)."""
    return _TRACER


def current() -> Context:
    """The context now (saved with work that goes on elsewhere)."""
    return otel_context.get_current()


@contextlib.contextmanager
def within(ctx: Context | None):
    """Runs the block in `ctx` (spans made and messages sent in it are its children)."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def child(ctx: Context | None, name: str):
    """A span `name` under `ctx`, current within the block; none when `ctx` is None (the request
    is not traced: tracing was off when it came)."""
    if ctx is None:
        yield
        return
    with within(ctx), _TRACER.start_as_current_span(name):
        yield


def record(
    name: str, parent: Context | None, start_s: float, end_s: float, **attributes
) -> Context | None:
    """A span of work already done, [start_s, end_s] in unix seconds, under `parent`; the
    context of that span (for its own children)."""
    span = _TRACER.start_span(
        name, context=parent, start_time=int(start_s * 1e9), attributes=attributes or None
    )
    if not span.is_recording():  # tracing off: nothing to end, nothing to parent
        return parent
    span.end(end_time=int(max(end_s, start_s) * 1e9))
    return trace.set_span_in_context(span, parent)


def now() -> float:
    return time.time()
