import ipaddress
import re
import uuid
from dataclasses import dataclass, field

from services.gateway.clients import TrustedProxies
from services.gateway.tool_format import PARSER_CHOICES
from shared.control import rules
from shared.settings import CommonSettings

MAX_TIMEOUT_S = 24 * 3600.0  # a day: the longest any connection bound may be


@dataclass
class GatewaySettings(CommonSettings):
    """Settings of the gateway (flags or TANDEM_* variables)."""

    # connection bounds of both API fronts (http_connections.py, grpc_bounds.py): how long a
    # request may take to arrive, how long a connection may idle or leave its answer unread, and
    # how many connections and calls may be open
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
    # the APIs, their clients and their requests
    grpc_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address the gRPC API listens on (0.0.0.0 only when configured)"},
    )
    grpc_port: int = field(default=50051, metadata={"help": "gRPC port; 0 = any free port"})
    http_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address the OpenAI-compatible HTTP API listens on"},
    )
    http_port: int = field(
        default=8000,
        metadata={"help": "OpenAI-compatible HTTP API port; 0 = any free port, -1 = no HTTP API"},
    )
    reuse_port: bool = field(
        default=False,
        metadata={
            "help": "listen with SO_REUSEPORT: several gateway processes on one host share the gRPC and HTTP ports, the kernel spreading connections across them (each a gateway of its own: its own id, its own --metrics-port); off, a second gateway on a port in use fails to start"
        },
    )
    served_model_name: str = field(
        default="",
        metadata={"help": "the model's name in the HTTP API (/v1/models); empty = its file name"},
    )
    allow_plaintext: bool = field(
        default=False,
        metadata={
            "help": "listen without TLS on an address other than loopback (prompts and API keys cross the network in the clear)"
        },
    )
    allow_anonymous: bool = field(
        default=False,
        metadata={
            "help": "serve an address other than loopback without API keys: anyone who reaches "
            "the port may use it, and every client behind one NAT, proxy or ingress is one client "
            "(one quota)"
        },
    )
    grpc_tls_cert: str = field(
        default="",
        metadata={"help": "server certificate (PEM); set = the gRPC API speaks TLS only"},
    )
    grpc_tls_key: str = field(
        default="", metadata={"help": "the server certificate's private key (PEM)"}
    )
    grpc_tls_client_ca: str = field(
        default="",
        metadata={
            "help": "CA (PEM) client certificates must be signed by; set = clients must show one"
        },
    )
    model: str = field(
        default="",
        metadata={
            "help": "the model the workers serve (its tokenizer and chat template are used here)"
        },
    )
    model_cache: str = field(
        default="~/.cache/tandem/models",
        metadata={"help": "where converted GGUF models are cached"},
    )
    max_model_len: int = field(
        default=0, metadata={"help": "longest prompt + output; 0 = the model's own limit"}
    )
    max_prompt_tokens: int = field(
        default=0,
        metadata={"help": "longest prompt, in tokens; 0 = up to the context (max_model_len)"},
    )
    default_max_tokens: int = field(
        default=256, metadata={"help": "max_tokens when a request leaves it unset"}
    )
    max_tokens_limit: int = field(
        default=4096, metadata={"help": "the largest max_tokens a request may ask for"}
    )
    max_stop_strings: int = field(
        default=16, metadata={"help": "how many stop strings a request may give"}
    )
    submit_timeout_s: float = field(
        default=20.0, metadata={"help": "how long the scheduler may take to place a request"}
    )
    direct_placement: bool = field(
        default=True,
        metadata={
            "help": "place a short first attempt straight on a worker a scheduler's heartbeat names as having room, while no scheduler has a request waiting (the scheduler's --direct-prompt-tokens says how short); off: every request through a scheduler"
        },
    )
    room_fresh_s: float = field(
        default=1.0,
        metadata={"help": "rooms and queue lengths a scheduler named longer ago are not used"},
    )
    dispatch_timeout_s: float = field(
        default=5.0,
        metadata={"help": "how long a worker may take to accept a request placed on it directly"},
    )
    stream_idle_timeout_s: float = field(
        default=300.0, metadata={"help": "a stream silent this long fails with UNAVAILABLE"}
    )
    worker_timeout_s: float = field(
        default=3.0,
        metadata={
            "help": "a decode worker silent this long is taken for dead: its streams move to another"
        },
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM: new requests are refused at once, streams in flight get this long to finish"
        },
    )
    max_request_bytes: int = field(
        default=1 << 20,
        metadata={
            "help": "the largest request message accepted; larger ones get RESOURCE_EXHAUSTED"
        },
    )
    max_streams: int = field(
        default=1024,
        metadata={
            "help": "requests this gateway serves at once, every client's together (each holds a connection or stream and its prompt); more: UNAVAILABLE (503)"
        },
    )
    max_queued: int = field(
        default=512,
        metadata={
            "help": "requests waiting (being validated, or for their first token) that clients share: a lone client may fill it, busy clients get equal shares over every gateway replica; past its share: RESOURCE_EXHAUSTED (429)"
        },
    )
    max_streams_per_client: int = field(
        default=0,
        metadata={
            "help": "streams one client (without a key of its own) may hold open at once over every replica; 0 = no cap beyond its fair share"
        },
    )
    max_queued_per_client: int = field(
        default=0,
        metadata={
            "help": "requests of one client waiting at once over every replica; 0 = no cap beyond its fair share of max_queued"
        },
    )
    max_kv_tokens_per_client: int = field(
        default=262_144,
        metadata={
            "help": "KV tokens (prompt + max_tokens) one client's open streams may reserve over every replica; 0 = no cap"
        },
    )
    trusted_proxies: str = field(
        default="",
        metadata={
            "help": "comma-separated addresses or networks of proxies (an ingress, a load balancer) whose X-Forwarded-For names the client; empty = a client is its connection's address"
        },
    )
    holdings_interval_s: float = field(
        default=0.25,
        metadata={
            "help": "how often the gateway tells the other replicas what its clients hold (limits and shares hold over all replicas)"
        },
    )
    default_max_priority: int = field(
        default=0,
        metadata={"help": "the highest priority a client without a key of its own may ask for"},
    )
    api_keys_file: str = field(
        default="",
        metadata={
            "help": "JSON file of API keys (names, keys, limits); set: every request needs one"
        },
    )
    max_migrations: int = field(
        default=2,
        metadata={
            "help": "times a request may move to another worker after the one serving it failed; past it, UNAVAILABLE"
        },
    )
    move_wait_s: float = field(
        default=10.0,
        metadata={
            "help": "a request being moved that no scheduler can place (no live worker could take it, or no scheduler listens: a NATS node cut off, a worker restarting) asks again for this long before it fails with UNAVAILABLE"
        },
    )
    tool_call_parser: str = field(
        default="auto",
        metadata={
            "help": "the format tool calls are read in with tool_choice auto: auto (the chat template's: Hermes <tool_call>, Llama 3.1 JSON or Mistral [TOOL_CALLS]; Hermes for a template without tools), hermes, llama3_json or mistral"
        },
    )
    gateway_id: str = field(default="", metadata={"help": "unique id; empty = random"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_connection_bounds()
        if not 0 <= self.grpc_port < 65536 or not -1 <= self.http_port < 65536:
            raise ValueError("grpc_port must be 0..65535, http_port -1..65535")
        if not 0 <= self.drain_timeout_s < float("inf"):
            raise ValueError("drain_timeout_s must be >= 0")
        if self.max_request_bytes < 1024 or self.max_streams < 1 or self.max_queued < 1:
            raise ValueError("max_request_bytes must be >= 1024, max_streams and max_queued >= 1")
        self._check_clients()
        if bool(self.grpc_tls_cert) != bool(self.grpc_tls_key) or (
            self.grpc_tls_client_ca and not self.grpc_tls_cert
        ):
            raise ValueError(
                "grpc_tls_cert and grpc_tls_key go together; grpc_tls_client_ca needs them"
            )
        self._check_published()
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_CHOICES)}")
        if not 0 <= self.max_migrations <= 16:
            raise ValueError("max_migrations must be in 0..16")
        if not 0 <= self.move_wait_s <= MAX_TIMEOUT_S:
            raise ValueError(f"move_wait_s must be in 0..{MAX_TIMEOUT_S:.0f}")
        if not (
            self.max_tokens_limit <= rules.MAX_LIST
            and self.max_stop_strings <= rules.MAX_STOP_STRINGS
        ):
            raise ValueError(
                f"max_tokens_limit must be <= {rules.MAX_LIST}, max_stop_strings <= {rules.MAX_STOP_STRINGS}"
            )
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens must be in 1..max_tokens_limit")
        if not self.gateway_id:
            self.gateway_id = f"gateway-{uuid.uuid4().hex[:8]}"
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.gateway_id):  # one NATS subject token
            raise ValueError(f"gateway_id must be 1-64 of A-Z a-z 0-9 _ -, got {self.gateway_id!r}")

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

    def _check_clients(self) -> None:
        per_client = (
            self.max_streams_per_client,
            self.max_queued_per_client,
            self.max_kv_tokens_per_client,
        )
        if min(per_client) < 0:
            raise ValueError("the per-client caps must be >= 0 (0: none)")
        self.require_seconds("holdings_interval_s", "room_fresh_s", "dispatch_timeout_s")
        TrustedProxies.parse(self.trusted_proxies)  # ValueError when one is not an address

    def _check_published(self) -> None:
        """An API beyond loopback needs TLS and API keys, or the settings that accept their lack."""
        hosts = [self.grpc_host] + ([self.http_host] if self.http_port >= 0 else [])
        for host in hosts:
            if not (self.grpc_tls_cert or self.allow_plaintext or _loopback(host)):
                raise ValueError(
                    f"{host} is not a loopback address and no TLS certificate is set: prompts "
                    "and API keys would cross the network in the clear. Give grpc_tls_cert and "
                    "grpc_tls_key (both APIs use them), or allow_plaintext to accept that"
                )
        public = [host for host in hosts if not _loopback(host)]
        if public and not (self.api_keys_file or self.allow_anonymous):
            raise ValueError(
                f"{public[0]} is not a loopback address and no API keys are set: anyone who "
                "reaches the port could use it, and every client behind one NAT or proxy would "
                "share one quota. Make a keys file (tandem api-keys --new FILE --name NAME) and "
                "give it as --api-keys-file (TANDEM_API_KEYS_FILE), or --allow-anonymous "
                "(TANDEM_ALLOW_ANONYMOUS=1) to accept that"
            )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
