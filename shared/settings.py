"""Settings: one dataclass per service, read once in main() from flags and TANDEM_* variables.

Precedence: command-line flag > TANDEM_<FIELD> environment variable > the dataclass default.
Each field's help text lives in its metadata: `field(default=..., metadata={"help": "..."})`.
"""

import argparse
import enum
import gc
import logging
import math
import os
import re
import ssl
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from shared.telemetry.request_log import RequestLogFilter

T = TypeVar("T")
_CLUSTER_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class CommonSettings:
    """Settings every service shares."""

    nats_url: str = field(
        default="nats://127.0.0.1:4222",
        repr=False,
        metadata=_help(
            "NATS server URL, or a cluster's URLs separated by commas (the client connects to one "
            "and, when it is lost, to another)"
        ),
    )
    cluster: str = field(
        default="default",
        metadata=_help(
            "cluster name: NATS subjects are namespaced by it, so stacks can share one NATS server"
        ),
    )
    log_level: str = field(default="INFO", metadata=_help("log level: DEBUG, INFO, WARNING, ERROR"))
    nats_user: str = field(
        default="", metadata=_help("NATS user (with a password); empty = no user")
    )
    nats_password: str = field(
        default="",
        repr=False,
        metadata=_help(
            "NATS password; prefer TANDEM_NATS_PASSWORD or --nats-password-file to a flag (flags show in ps)"
        ),
    )
    nats_password_file: str = field(default="", metadata=_help("a file holding the NATS password"))
    nats_token: str = field(
        default="", repr=False, metadata=_help("NATS token (instead of user and password)")
    )
    nats_token_file: str = field(default="", metadata=_help("a file holding the NATS token"))
    nats_tls_ca: str = field(
        default="", metadata=_help("CA certificate to verify the NATS server by; set = TLS")
    )
    nats_tls_cert: str = field(
        default="", metadata=_help("client certificate for NATS TLS (with --nats-tls-key)")
    )
    nats_tls_key: str = field(default="", metadata=_help("client key for NATS TLS"))
    nats_connect_timeout_s: float = field(
        default=2.0,
        metadata=_help("how long connecting to one NATS server may take before the next is tried"),
    )
    nats_ping_interval_s: float = field(
        default=1.0,
        metadata=_help(
            "seconds between pings of the NATS server; one silent for 3 of them is given up for "
            "another (with the defaults a client is on another server within about 5 s)"
        ),
    )
    nats_reconnect_wait_s: float = field(
        default=0.5,
        metadata=_help("how long before a NATS server that could not be reached is tried again"),
    )
    nats_drain_timeout_s: float = field(
        default=5.0,
        metadata=_help(
            "on shutdown, how long sending what is queued for NATS may take before the connection "
            "is closed anyway"
        ),
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata=_help(
            "address the Prometheus metrics endpoint listens on; @hostname = the address this "
            "host's name resolves to (a container's or pod's own network address)"
        ),
    )
    metrics_port: int = field(
        default=-1,
        metadata=_help("Prometheus metrics port (/metrics); -1 = none, 0 = any free port"),
    )
    gil_switch_ms: float = field(
        default=0.5,
        metadata=_help(
            "how long a thread may hold Python's GIL while another waits (Python's own: 5 ms): "
            "the event loop, gRPC's poller and the model's thread hand over sooner"
        ),
    )
    otlp_endpoint: str = field(
        default="",
        metadata=_help(
            "OTLP/HTTP endpoint traces go to, e.g. http://collector:4318; empty = "
            "OTEL_EXPORTER_OTLP_ENDPOINT, or no tracing"
        ),
    )

    def __post_init__(self) -> None:
        if not all(url.strip() for url in self.nats_url.split(",")):
            # (not the URLs themselves: one may hold a password)
            raise ValueError("nats_url: an empty URL in the comma-separated list")
        self.nats_password = self.nats_password or _secret_file(self.nats_password_file)
        self.nats_token = self.nats_token or _secret_file(self.nats_token_file)
        if self.nats_token and self.nats_user:
            raise ValueError("give a NATS user and password, or a token, not both")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ValueError("nats_tls_cert and nats_tls_key go together")
        if not _CLUSTER_RE.fullmatch(self.cluster):
            raise ValueError(f"cluster must be 1-64 of A-Z a-z 0-9 _ -, got {self.cluster!r}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError("metrics_port must be -1..65535")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"unknown log level {self.log_level!r}")
        if not 0.05 <= self.gil_switch_ms <= 100:
            raise ValueError("gil_switch_ms must be 0.05..100")
        self.require_seconds(
            "nats_connect_timeout_s",
            "nats_ping_interval_s",
            "nats_reconnect_wait_s",
            "nats_drain_timeout_s",
        )

    def require_seconds(self, *names: str) -> None:
        """Each named field is a positive, finite number of seconds (ValueError naming it)."""
        for name in names:
            if not 0 < getattr(self, name) < math.inf:  # NaN too
                raise ValueError(f"{name} must be a positive number of seconds")


def _secret_file(path: str) -> str:
    """The secret in `path` (one line; surrounding whitespace dropped); "" when no path is given."""
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as err:
        raise ValueError(f"cannot read the secret file {path}: {err.strerror}") from None


def nats_options(settings: CommonSettings) -> dict:
    """How to connect to NATS (nats.connect keyword arguments): credentials and TLS from settings."""
    options: dict = {}
    if settings.nats_user:
        options.update(user=settings.nats_user, password=settings.nats_password)
    if settings.nats_token:
        options["token"] = settings.nats_token
    if settings.nats_tls_ca:
        context = ssl.create_default_context(cafile=settings.nats_tls_ca)
        if settings.nats_tls_cert:
            context.load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key)
        options["tls"] = context
    return options


def env_name(name: str) -> str:
    return "TANDEM_" + name.upper()


def _choices(kind: type) -> list[str] | None:
    """The values a field of a string enum type may take (None: any of its type)."""
    return (
        [m.value for m in kind] if isinstance(kind, type) and issubclass(kind, enum.Enum) else None
    )


def _convert(kind: type, text: str, name: str):
    choices = _choices(kind)
    if choices is not None:
        if text not in choices:
            raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {text!r}")
        return kind(text)
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: expected a boolean, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: expected {kind.__name__}, got {text!r}") from None


def load_settings(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
) -> T:
    """Builds `cls` from flags (`--field-name`) and TANDEM_FIELD_NAME variables; exits 2 on bad input."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    for f in fields(cls):
        kind = hints[f.name]
        default = f.default if f.default is not MISSING else "(computed)"
        default = default.value if isinstance(default, enum.Enum) else default
        text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}, default {default!r}]"
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            parser.add_argument(
                flag,
                type=str,
                default=None,
                help=text,
                choices=_choices(kind),
                metavar=kind.__name__.upper(),
            )
    args = parser.parse_args(argv)
    values = {}
    try:
        for f in fields(cls):
            given = getattr(args, f.name)
            if given is None and env_name(f.name) in env:
                given = env[env_name(f.name)]
            if given is None:
                continue
            kind = hints[f.name]
            values[f.name] = given if isinstance(given, bool) else _convert(kind, given, f.name)
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def setup_interpreter(settings: CommonSettings) -> None:
    """The process-wide interpreter settings a service runs with (set once, in main())."""
    sys.setswitchinterval(settings.gil_switch_ms / 1000)


def started() -> None:
    """Called once a service has loaded what it lives with (modules, model, tokenizer, its
    clients): those objects move out of the garbage collector's generations (gc.freeze), so a
    full collection walks only what serving made since, not the hundreds of thousands of
    objects the imports and the model left (a full collection had taken ~0.2 s of a worker's
    event loop: docs/benchmarks.md, the control plane)."""
    gc.collect()
    gc.freeze()


def setup_logging(level: str, service: str) -> None:
    """Log lines name the service and, within a request, its id (and trace id)."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {service} %(name)s%(request)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestLogFilter())
    # Third-party chatter at INFO drowns our own lines.
    for noisy in ("nats", "ucxx", "httpx", "transformers"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))
