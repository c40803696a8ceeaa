"""KVConnector: how KV moves from a prefill worker's pool into a decode worker's, one class each
way of moving it, chosen by configuration (`--kv-connector`).

The decode side:
- reserve: `reserve()` makes the plan over the blocks the engine reserved, and the KVReceiver
  that will fill them (nothing posted yet);
- post receives: `KVReceiver.start`, before the prefill worker is asked for anything;
- complete: `KVReceiver.complete`, every piece landed where attention reads it;
- abort: `KVReceiver.abort` ends every receive still posted before the blocks may go.
The prefill side:
- plan: `sender()` derives the same plan from the PrefillTask's KVDestination;
- send: `KVSender.stage` / `gather` / `send`, a segment as soon as its tokens are computed;
- abort: no more segments (OutboundTransfer.abort); pieces on the wire are drained by the
  decode side.
A plan names, for every piece, its route (the sending rank, the receiving rank, their KV heads)
and its runs of decode blocks (plan.py): between tensor-parallel groups of any two degrees every
connector cuts each segment per route, each rank's pool holding its own heads only. The decode worker names its connector in the KVDestination; the prefill
worker builds the same one, and refuses a name it does not know.
"""

from abc import ABC, abstractmethod
from typing import ClassVar

from shared.control.messages import KVDestination, KVLayout
from shared.dataplane.plane import DataPlane
from shared.engine.kv_cache import KVPool
from shared.kvtransfer.plan import PlanError, TransferPlan, piece_per_run, piece_per_segment
from shared.kvtransfer.receiver import KVReceiver
from shared.kvtransfer.sender import KVSender


class KVConnector(ABC):
    name: ClassVar[str]

    def __init__(self, plane: DataPlane, pools: list[KVPool]):
        self.plane = plane
        self.pools = pools  # each rank's, rank 0 first (one for a worker without TP)

    @abstractmethod
    def plan(self, layout: KVLayout, prompt_len: int, destination: KVDestination) -> TransferPlan:
        """How this connector cuts the prompt's KV into pieces (alike on both ends)."""

    def reserve(self, layout: KVLayout, prompt_len: int, destination: KVDestination) -> KVReceiver:
        """Decode side: the receiver of the blocks `destination` names (nothing posted yet)."""
        return KVReceiver(self.plane, self.pools, self.plan(layout, prompt_len, destination))

    def sender(self, layout: KVLayout, prompt_len: int, destination: KVDestination) -> KVSender:
        """Prefill side: the sender of the prompt's KV to `destination`, its lease as timeout."""
        plan = self.plan(layout, prompt_len, destination)
        return KVSender(self.plane, self.pools, plan, destination.lease_s)


class PushConnector(KVConnector):
    """One message per run of consecutive decode blocks, received in place: no copy on the
    decode side; the prefill side copies only a run whose own blocks are scattered."""

    name = "push"

    def plan(self, layout: KVLayout, prompt_len: int, destination: KVDestination) -> TransferPlan:
        return TransferPlan(layout, prompt_len, destination, piece_per_run)


class StagedConnector(KVConnector):
    """One message per segment, however scattered the blocks on either side: the prefill side
    gathers the segment's runs into one buffer (the helper plane does it in its process), the
    decode side receives it into one staging buffer and scatters it into its blocks. Fewer,
    larger messages for a copy on each side: for fragmented pools, and transports whose fixed
    cost per message is high."""

    name = "staged"

    def plan(self, layout: KVLayout, prompt_len: int, destination: KVDestination) -> TransferPlan:
        return TransferPlan(layout, prompt_len, destination, piece_per_segment)


CONNECTORS: dict[str, type[KVConnector]] = {c.name: c for c in (PushConnector, StagedConnector)}


def connector(name: str, plane: DataPlane, pools: list[KVPool]) -> KVConnector:
    """The connector called `name` over each rank's pool; PlanError for a name this worker
    does not know."""
    if name not in CONNECTORS:
        raise PlanError(f"unknown KV connector {name!r} (this worker has {sorted(CONNECTORS)})")
    return CONNECTORS[name](plane, pools)
