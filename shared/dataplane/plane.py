"""DataPlane: the interface a KV transport offers (UcxDataPlane in shared/dataplane/ucx.py, the
same in a helper process in helper_plane.py, the fake tests/fakes/dataplane.py), its errors and
counters, and what every transport does alike: discard() takes unwanted messages off the wire,
scatter() lands one message in several spans.

Tensors move worker-to-worker on it, never through NATS: the receiving side posts a tagged
receive into its own buffer, the sending side sends with that tag to the receiver's address. A
buffer is a tensor (or an array), or a list of them: sent as one message (gathered), received
as one message (scattered over them in order, through one staging buffer).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy

if TYPE_CHECKING:
    import torch


class KVTransferError(Exception):
    """A transfer that did not complete; the request it belonged to fails."""


class PlaneRestarted(KVTransferError):
    """This worker's own data plane lost the transfer (its helper process was replaced): the
    peer is not at fault, and the request may be placed again anywhere."""


class ReceiveReleased(KVTransferError):
    """release() ended a posted receive before any data came."""


@dataclass
class TransferCounters:
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_failed: int = 0
    receives_released: int = 0  # posted receives ended by release() instead of data
    plane_restarts: int = 0  # data-plane helper processes replaced (HelperDataPlane)


class DataPlane(Protocol):
    address: bytes
    counters: TransferCounters
    gathers: bool  # a send's list of spans is gathered by the plane (off the worker's threads);
    # False: the caller hands it one contiguous buffer per message

    async def send(
        self, peer_address: bytes, tag: int, buffer: torch.Tensor, timeout: float
    ) -> None:
        """Sends `buffer` to the peer's receive posted with `tag`."""

    async def send_many(
        self, peer_address: bytes, pieces: list[tuple[int, torch.Tensor]], timeout: float
    ) -> None:
        """Sends every (tag, buffer) at once; returns when all have left, `timeout` in all."""

    async def receive(self, tag: int, buffer: torch.Tensor) -> int:
        """Receives the message sent with `tag` into `buffer`; its byte count. Raises KVTransferError
        if release() ended it before any data came."""

    async def ready(self, timeout: float) -> bool:
        """Whether the plane can carry a transfer, waiting up to `timeout` while it restarts
        (a helper process replaced); its `address` is then the one to announce."""

    def post_receives(self, pieces: list[tuple[int, torch.Tensor]]) -> list[asyncio.Future]:
        """Posts a receive per (tag, buffer) now; one future each, as receive() would return."""

    async def release(self, tags: list[int], timeout: float = 10.0) -> None:
        """Ends the receives posted with these tags that no data has matched yet; returns when
        none of them can write into its buffer any more, or after `timeout` (a receive that data
        matched but that never completed stays open)."""

    async def discard(self, pieces: list[tuple[int, int]], timeout: float) -> None:
        """Takes (tag, size) messages nobody wants off the wire (see discard())."""

    def transports(self) -> str:
        """The transports this worker's endpoints use, e.g. "sysv+posix+cma" ("" before any send)."""

    def transport_to(self, peer_address: bytes) -> str:
        """The transports of the endpoint to this peer ("" when none is open)."""


async def discard(plane: DataPlane, pieces: list[tuple[int, int]], timeout: float) -> None:
    """Takes (tag, size) messages nobody wants off the wire (their transfer was aborted after
    they were sent), all into one scratch buffer; those that do not come within `timeout` are
    released."""
    if not pieces:
        return
    scratch = numpy.empty(max(n for _, n in pieces), dtype=numpy.uint8)  # the bytes are garbage
    futures = plane.post_receives([(tag, scratch[:n]) for tag, n in pieces])
    _, pending = await asyncio.wait(futures, timeout=timeout)
    if pending:
        await plane.release([tag for (tag, _), f in zip(pieces, futures) if f in pending])
    await asyncio.gather(*futures, return_exceptions=True)


def nbytes(buffer: torch.Tensor | numpy.ndarray | list) -> int:
    """A buffer's size; of a list of spans (a piece a helper plane gathers), their sum."""
    return sum(nbytes(part) for part in buffer) if isinstance(buffer, list) else buffer.nbytes


def staging(spans: list) -> torch.Tensor | numpy.ndarray:
    """One contiguous byte buffer as large as `spans`, where they are (host or device)."""
    if isinstance(spans[0], numpy.ndarray):
        return numpy.empty(nbytes(spans), dtype=numpy.uint8)
    import torch  # the helper process runs without torch: only its own buffers come here

    return torch.empty(nbytes(spans), dtype=torch.uint8, device=spans[0].device)


@dataclass(frozen=True)
class Assembly:
    """A buffer to send that a gathering plane puts together itself: `nbytes` in all, each part
    (offset, shape, strides, view) placed at its offset with that shape and those strides, all
    in bytes (the last dimension contiguous); see shared.kvtransfer.assembly."""

    nbytes: int
    parts: list[tuple[int, list[int], list[int], object]]


def contiguous(buffer) -> bool:
    """Whether a buffer is one range of memory (a strided view, e.g. some KV heads of a pool's
    blocks, is not: it is gathered to be sent and scattered on landing)."""
    if isinstance(buffer, numpy.ndarray):
        return buffer.flags.c_contiguous
    return buffer.is_contiguous()


def gathered(buffer):
    """A strided view copied into one contiguous buffer; a contiguous one as it is."""
    if contiguous(buffer):
        return buffer
    if isinstance(buffer, numpy.ndarray):
        return numpy.ascontiguousarray(buffer)
    return buffer.contiguous()


def scatter(staged, spans: list) -> None:
    """Copies a landed staging buffer into its spans, in order (a strided one element-wise)."""
    at = 0
    for span in spans:
        size = span.nbytes
        if isinstance(span, numpy.ndarray):
            part = staged[at : at + size].view(span.dtype).reshape(span.shape)
            span[...] = part
        else:
            span.copy_(staged[at : at + size].view(span.dtype).view(span.shape))
        at += size
