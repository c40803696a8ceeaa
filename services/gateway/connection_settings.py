"""The gateway's connection bounds, as settings (part of GatewaySettings): how long a request
may take to arrive, how long a connection may idle or leave its answer unread, and how many
connections and calls may be open (services/gateway/http_connections.py, grpc_bounds.py)."""

from dataclasses import dataclass, field

from shared.settings import CommonSettings

MAX_TIMEOUT_S = 24 * 3600.0  # a day: the longest any connection bound may be


@dataclass
class ConnectionSettings(CommonSettings):
    """Connection bounds of both API fronts (flags or TANDEM_* variables)."""

    read_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "a request must arrive whole within this long (HTTP: headers and body, from its first byte: 408, or closed before its headers came; gRPC: the connection's handshake and each call's request: DEADLINE_EXCEEDED)"
        },
    )
    write_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "a client that reads none of its answer for this long is cut off and its request cancelled (HTTP: the connection's send buffer stays full; gRPC: a response waits to be sent)"
        },
    )
    http_idle_timeout_s: float = field(
        default=15.0,
        metadata={"help": "an HTTP connection that sends no byte of a request this long is closed"},
    )
    http_max_connections: int = field(
        default=1024,
        metadata={"help": "HTTP connections open at once; one more is answered 503 and closed"},
    )
    http_linger_s: float = field(
        default=2.0,
        metadata={
            "help": "what a client still sends after a 503 or 408 is read and dropped this long before its connection closes (so it reads the answer, not a reset)"
        },
    )
    http_send_buffer_bytes: int = field(
        default=256 * 1024,
        metadata={
            "help": "each HTTP connection's kernel send buffer: what a client that stops reading can leave unsent before write_timeout_s starts (0 = the kernel's, which grows to MBs)"
        },
    )
    grpc_max_connections: int = field(
        default=1024,
        metadata={"help": "gRPC connections open at once; more are closed as they come"},
    )
    grpc_max_concurrent_rpcs: int = field(
        default=1024,
        metadata={
            "help": "gRPC calls open at once (streams, status and health checks); one more gets RESOURCE_EXHAUSTED"
        },
    )
    grpc_idle_timeout_s: float = field(
        default=300.0,
        metadata={"help": "a gRPC connection with no call this long is closed (GOAWAY)"},
    )
    grpc_keepalive_s: float = field(
        default=60.0,
        metadata={
            "help": "a quiet gRPC connection is pinged this often, and closed (its calls cancelled) when a ping goes this long unanswered"
        },
    )
    grpc_max_connection_age_s: float = field(
        default=3600.0,
        metadata={
            "help": "a gRPC connection this old is asked to reconnect (GOAWAY; clients do it unseen); 0 = never"
        },
    )
    grpc_connection_age_grace_s: float = field(
        default=600.0,
        metadata={
            "help": "calls still open on a connection asked to reconnect get this long; then it closes"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_connection_bounds()

    def _check_connection_bounds(self) -> None:
        timeouts = (
            "read_timeout_s",
            "write_timeout_s",
            "http_idle_timeout_s",
            "http_linger_s",
            "grpc_idle_timeout_s",
            "grpc_keepalive_s",
            "grpc_connection_age_grace_s",
        )
        self.require_seconds(*timeouts)
        for name in (*timeouts, "grpc_max_connection_age_s"):
            if not 0 <= getattr(self, name) <= MAX_TIMEOUT_S:  # gRPC takes int32 milliseconds
                raise ValueError(f"{name} must be at most {MAX_TIMEOUT_S:.0f} seconds")
        if self.http_send_buffer_bytes and not 4096 <= self.http_send_buffer_bytes <= 1 << 30:
            raise ValueError("http_send_buffer_bytes must be 0 (the kernel's) or 4096..1 GiB")
        caps = (self.http_max_connections, self.grpc_max_connections, self.grpc_max_concurrent_rpcs)
        if min(caps) < 1:
            raise ValueError(
                "http_max_connections, grpc_max_connections and grpc_max_concurrent_rpcs must be >= 1"
            )
