"""What a gateway's clients hold there, told to the other gateway replicas (GatewayHoldings).

Client limits and fair shares hold over every replica, not per replica: each gateway publishes
what its clients hold (streams, queued requests, KV tokens reserved) a few times a second, and adds
what the others last said to its own when it decides whether a client may have one more. Client
names are the gateway's own ("key:<name>", "cert:<subject>", "addr:<host>"); never a key."""

from dataclasses import dataclass, field


@dataclass
class ClientHolding:
    client: str
    streams: int = 0
    queued: int = 0  # being validated, or waiting for the first token
    kv_tokens: int = 0


@dataclass
class GatewayHoldings:
    gateway_id: str
    queued_capacity: int = 0  # this gateway's part of the queue clients share
    clients: list[ClientHolding] = field(default_factory=list)  # those holding anything
    stopping: bool = False  # leaving: forget what it said
