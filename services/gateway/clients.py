"""Clients: who sent a request, what they may ask for, and what they hold at this gateway.

A client is known by its API key's name (gRPC metadata `authorization: Bearer <key>`, keys from
--api-keys-file), else by its TLS certificate's subject, else by its address: the connection's
peer, or, when the peer is a trusted proxy (--trusted-proxies), the client address that proxy
forwarded (X-Forwarded-For: the last address in it that is not itself a trusted proxy). With keys
configured, a request without a valid one gets UNAUTHENTICATED. Keys are compared by their
SHA-256 digest and never logged.

Each client has a policy: the highest priority it may ask for (more is lowered to it), and caps of
its own on what it holds at once over every gateway replica: open streams, streams still waiting
for their first token, and KV tokens reserved (prompt + max_tokens of each open stream); 0: no cap
of its own, only its fair share (seats.py). Past a limit: RESOURCE_EXHAUSTED with a retry-after
hint.

The keys file is JSON: {"clients": [{"name": "team-a", "key": "...", "max_priority": 10,
"max_streams": 128, "max_queued": 64, "max_kv_tokens": 1000000}, ...]}; any limit left out is
the gateway's default.
"""

import dataclasses
import hashlib
import ipaddress
import json
from pathlib import Path

RETRY_AFTER_MS = 1000


@dataclasses.dataclass(frozen=True)
class ClientPolicy:
    max_priority: int = 0
    max_streams: int = 0  # 0: no cap of its own
    max_queued: int = 0
    max_kv_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Client:
    name: str  # "key:<name>", "cert:<subject>" or "addr:<host>"
    policy: ClientPolicy


class Unauthenticated(Exception):
    """Keys are configured and the request has no valid one."""


class ClientKeys:
    """The API keys a gateway accepts, by digest, with each key's name and policy."""

    def __init__(
        self,
        default: ClientPolicy,
        entries: dict[bytes, tuple[str, ClientPolicy]],
        proxies: "TrustedProxies | None" = None,
    ):
        self.default = default
        self._by_digest = entries
        self.proxies = proxies or TrustedProxies(())

    @classmethod
    def load(
        cls, path: str, default: ClientPolicy, proxies: "TrustedProxies | None" = None
    ) -> "ClientKeys":
        """Keys from the JSON file at `path`; none when `path` is empty."""
        if not path:
            return cls(default, {}, proxies)
        doc = json.loads(Path(path).read_text())
        entries = {}
        for n, item in enumerate(doc.get("clients", [])):
            if not isinstance(item, dict) or "name" not in item or "key" not in item:
                raise ValueError(f"{path}: client {n} needs a name and a key")
            name, key = str(item["name"]), str(item["key"])
            if len(key) < 16:
                raise ValueError(f"the key of client {name!r} is shorter than 16 characters")
            limits = {
                f.name: int(item[f.name])
                for f in dataclasses.fields(ClientPolicy)
                if f.name in item
            }
            entries[_digest(key)] = (name, dataclasses.replace(default, **limits))
        if not entries:  # a file that names no client would leave the API open to anyone
            raise ValueError(f"{path}: no client keys (make one: tandem api-keys --new FILE)")
        return cls(default, entries, proxies)

    @property
    def required(self) -> bool:
        return bool(self._by_digest)

    def identify(self, metadata, cert_subject: str, peer: str) -> Client:
        """The client a request comes from; Unauthenticated when keys are required and it has
        no valid one."""
        if self.required:
            token = _bearer(metadata)
            found = self._by_digest.get(_digest(token)) if token else None
            if found is None:
                raise Unauthenticated(
                    "a valid API key is required (metadata authorization: Bearer <key>)"
                )
            name, policy = found
            return Client(f"key:{name}", policy)
        if cert_subject:
            return Client(f"cert:{cert_subject}", self.default)
        return Client(f"addr:{self.proxies.client_of(peer, metadata)}", self.default)


class TrustedProxies:
    """The proxies whose X-Forwarded-For names the client (by network); none: every client is
    its connection's peer address."""

    HEADER = "x-forwarded-for"

    def __init__(self, networks):
        self.networks = tuple(ipaddress.ip_network(n, strict=False) for n in networks)

    @classmethod
    def parse(cls, value: str) -> "TrustedProxies":
        """From a comma-separated list of addresses or networks ("10.0.0.0/8,127.0.0.1")."""
        return cls(n.strip() for n in value.split(",") if n.strip())

    def client_of(self, peer: str, metadata) -> str:
        """The client's address: `peer` ("ipv4:10.0.0.7"), or where that is a trusted proxy, the
        last forwarded address that is not one (unchanged when the header has none)."""
        if not self.networks or not self._trusted(_host(peer)):
            return peer
        forwarded = [v for k, v in metadata or () if k.lower() == self.HEADER]
        hops = [h.strip() for v in forwarded for h in str(v).split(",")]
        for hop in reversed(hops):
            address = _ip(hop)
            if address is None:
                return peer  # a malformed header: the proxy's own address, not a made-up one
            if not self._trusted(address):
                return f"ipv4:{address}" if address.version == 4 else f"ipv6:[{address}]"
        return peer

    def _trusted(self, address) -> bool:
        return address is not None and any(address in n for n in self.networks)


def _host(peer: str):
    """The address in a gRPC-style peer string ("ipv4:10.0.0.7", "ipv6:[::1]"), or None."""
    kind, _, host = peer.partition(":")
    return _ip(host) if kind in ("ipv4", "ipv6") else None


def _ip(text: str):
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def cert_subject(auth_context: dict) -> str:
    """The common name of a client's verified TLS certificate ("" without one)."""
    names = auth_context.get("x509_common_name") or []
    return names[0].decode(errors="replace") if names else ""


def _bearer(metadata) -> str:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
