"""The HTTP API's stand-in for a gRPC call context, and gRPC statuses as OpenAI's errors.

The OpenAI-compatible API runs the very request path of the gRPC API (TandemServicer.Generate),
which reads its caller from a grpc ServicerContext and ends a call with `context.abort`. Here,
HttpCallContext answers the same questions from the HTTP request (its Authorization header, its
peer, its client certificate, its X-Request-Timeout), and `abort` raises CallAborted, which the
HTTP handler turns into OpenAI's error body with the matching HTTP status.
"""

import math
import time
from dataclasses import dataclass

import grpc

# gRPC status -> (HTTP status, OpenAI's error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds the client gives the request: its deadline
MAX_TIMEOUT_S = 24 * 3600.0


class CallAborted(Exception):
    """The request path ended the call with a gRPC status (context.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: int = 0):
        super().__init__(details)
        self.code, self.details, self.retry_after_ms = code, details, retry_after_ms


@dataclass
class HttpError:
    """An error as OpenAI's API answers it: the HTTP status, its body and headers."""

    status: int
    body: dict
    headers: dict


def http_error(
    code: grpc.StatusCode, message: str, retry_after_ms: int = 0, param: str | None = None
) -> HttpError:
    status, kind = HTTP_STATUS.get(code, (500, "server_error"))
    headers = {}
    if status == 429:
        headers["Retry-After"] = str(max(1, math.ceil((retry_after_ms or 1000) / 1000)))
    body = {"error": {"message": message, "type": kind, "param": param, "code": code.name.lower()}}
    return HttpError(status, body, headers)


def parse_timeout(value: str | None) -> float | None:
    """The X-Request-Timeout header's seconds (None: no deadline); ValueError when malformed."""
    if value is None:
        return None
    seconds = float(value)
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise ValueError(f"{TIMEOUT_HEADER} must be seconds in (0, {MAX_TIMEOUT_S:.0f}]")
    return seconds


class HttpCallContext:
    """What TandemServicer asks of a gRPC context, answered for one HTTP request."""

    api = "openai"  # the metrics' label

    def __init__(
        self,
        authorization: str | None,
        peer: tuple[str, int] | None,
        cert_subject: str = "",
        timeout_s: float | None = None,
        forwarded_for: tuple[str, ...] = (),
    ):
        self._metadata = (("authorization", authorization),) if authorization else ()
        self._metadata += tuple(("x-forwarded-for", hop) for hop in forwarded_for)
        self._peer = peer
        self._cert_subject = cert_subject
        self._deadline = time.monotonic() + timeout_s if timeout_s else None
        self.retry_after_ms = 0

    def invocation_metadata(self):
        return self._metadata

    def auth_context(self) -> dict:
        return {"x509_common_name": [self._cert_subject.encode()]} if self._cert_subject else {}

    def peer(self) -> str:
        """As gRPC writes it: "ipv4:10.0.0.7:5123", "ipv6:[::1]:5123"."""
        if not self._peer:
            return "unknown"
        host, port = self._peer
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, metadata) -> None:
        for key, value in metadata:
            if key == "retry-after-ms":
                self.retry_after_ms = int(value)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise CallAborted(code, details, self.retry_after_ms)
