"""Log lines of a request carry its id (and its trace id when tracing is on).

The bus sets the request of each message it hands a handler (`request_scope`); a filter on the
log handler adds `request` to every record: "" outside one, else " [<attempt id>]" (with
" trace=<id>" when a span is current).
"""

import asyncio
import contextlib
import contextvars
import logging

from opentelemetry import trace

REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_request", default="")


@contextlib.contextmanager
def request_scope(attempt_id: str):
    token = REQUEST.set(attempt_id)
    try:
        yield
    finally:
        REQUEST.reset(token)


class RequestLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request = REQUEST.get()
        span_context = trace.get_current_span().get_span_context()
        traced = f" trace={span_context.trace_id:032x}" if span_context.is_valid else ""
        record.request = f" [{request}{traced}]" if request or traced else ""
        return True


def detached(coro) -> asyncio.Task:
    """A task that carries no request's context: one started while a message is handled would
    otherwise name that request (and trace) in everything it logs and sends, for good."""
    return contextvars.Context().run(asyncio.create_task, coro)
