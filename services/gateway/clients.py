"""Clients: who sent a request, what they may ask for, and what they hold at this gateway.

A client is known by its API key's name (gRPC metadata `authorization: Bearer <key>`, keys from
--api-keys-file), else by its TLS certificate's subject, else by its address. With keys
configured, a request without a valid one gets UNAUTHENTICATED. Keys are compared by their
SHA-256 digest and never logged.

Each client has a policy: the highest priority it may ask for (more is lowered to it), and limits
on what it holds here at once: open streams, streams still waiting for their first token, and KV
tokens reserved (prompt + max_tokens of each open stream). Past a limit: RESOURCE_EXHAUSTED with
a retry-after hint. The defaults are well below the cluster's own bounds, so no one client can
take all of it.

The keys file is JSON: {"clients": [{"name": "team-a", "key": "...", "max_priority": 10,
"max_streams": 128, "max_queued": 64, "max_kv_tokens": 1000000}, ...]}; any limit left out is
the gateway's default.
"""

import collections
import dataclasses
import hashlib
import json
from pathlib import Path

RETRY_AFTER_MS = 1000


@dataclasses.dataclass(frozen=True)
class ClientPolicy:
    max_priority: int = 0
    max_streams: int = 64
    max_queued: int = 32
    max_kv_tokens: int = 262_144


@dataclasses.dataclass(frozen=True)
class Client:
    name: str  # "key:<name>", "cert:<subject>" or "addr:<host>"
    policy: ClientPolicy


class Unauthenticated(Exception):
    """Keys are configured and the request has no valid one."""


class ClientKeys:
    """The API keys a gateway accepts, by digest, with each key's name and policy."""

    def __init__(self, default: ClientPolicy, entries: dict[bytes, tuple[str, ClientPolicy]]):
        self.default = default
        self._by_digest = entries

    @classmethod
    def load(cls, path: str, default: ClientPolicy) -> "ClientKeys":
        """Keys from the JSON file at `path`; none when `path` is empty."""
        if not path:
            return cls(default, {})
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
        return cls(default, entries)

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
        return Client(f"addr:{peer}", self.default)


class ClientUsage:
    """What each client holds at this gateway now (streams, streams waiting, KV tokens)."""

    def __init__(self) -> None:
        self.streams: collections.Counter[str] = collections.Counter()
        self.queued: collections.Counter[str] = collections.Counter()
        self.kv_tokens: collections.Counter[str] = collections.Counter()

    def over_limit(self, client: Client, kv_tokens: int) -> str | None:
        """Why one more stream of `kv_tokens` would take the client past its limits (None: it
        would not)."""
        p, name = client.policy, client.name
        if self.streams[name] >= p.max_streams:
            return f"this client already has {p.max_streams} streams open, its limit"
        if self.queued[name] >= p.max_queued:
            return f"this client already has {p.max_queued} requests waiting, its limit"
        if self.kv_tokens[name] + kv_tokens > p.max_kv_tokens:
            return (
                f"this client's open streams would reserve more than {p.max_kv_tokens} KV "
                f"tokens (prompt + max_tokens), its limit"
            )
        return None

    def open(self, client: Client, kv_tokens: int) -> None:
        self.streams[client.name] += 1
        self.queued[client.name] += 1
        self.kv_tokens[client.name] += kv_tokens

    def started(self, client: Client) -> None:
        """Its first token came: no longer waiting."""
        _decrement(self.queued, client.name)

    def close(self, client: Client, kv_tokens: int, started: bool) -> None:
        _decrement(self.streams, client.name)
        _decrement(self.kv_tokens, client.name, kv_tokens)
        if not started:
            _decrement(self.queued, client.name)


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


def _decrement(counter: collections.Counter, name: str, by: int = 1) -> None:
    counter[name] -= by
    if counter[name] <= 0:
        del counter[name]
