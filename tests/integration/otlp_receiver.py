"""An OTLP/HTTP trace receiver of our own: what the services export, decoded (protobuf)."""

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict


class OtlpReceiver:
    """POST /v1/traces on a free loopback port while entered; `spans` is what came."""

    def __init__(self):
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the http.server API)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def take(self, request) -> None:
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    span = Span(
                        attrs.get("service.name", ""),
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                    )
                    with self.lock:
                        self.spans.append(span)

    def __enter__(self) -> "OtlpReceiver":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(value):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
