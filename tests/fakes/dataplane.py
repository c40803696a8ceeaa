"""The in-process fake of the KV data plane, for unit tests: same contract as UcxDataPlane."""

import asyncio

import numpy
import torch

from shared.dataplane.plane import (
    KVTransferError,
    PlaneRestarted,
    ReceiveReleased,
    TransferCounters,
    discard,
    gathered,
    nbytes,
    scatter,
    staging,
)


class LoopbackNetwork:
    """Connects InProcessDataPlanes of one process to one another (unit tests)."""

    def __init__(self) -> None:
        self.planes: dict[bytes, InProcessDataPlane] = {}


class InProcessDataPlane:
    """The test fake: same contract as UcxDataPlane, bytes copied in-process.

    A send waits for the matching receive like UCX's rendezvous protocol does; `hold` makes
    sends to this plane stall (a peer that stopped reading).
    """

    gathers = False  # as UcxDataPlane: one contiguous buffer per piece sent

    def __init__(self, network: LoopbackNetwork, name: str):
        self.address = name.encode()
        self.counters = TransferCounters()
        self.hold = False
        self._network = network
        self._posted: dict[int, tuple[torch.Tensor, asyncio.Future]] = {}
        self._unexpected: dict[int, asyncio.Future] = {}
        network.planes[self.address] = self

    def transports(self) -> str:
        return "inprocess"

    def transport_to(self, peer_address: bytes) -> str:
        return "inprocess" if peer_address in self._network.planes else ""

    async def send(
        self, peer_address: bytes, tag: int, buffer: torch.Tensor, timeout: float
    ) -> None:
        await self.send_many(peer_address, [(tag, buffer)], timeout)

    async def send_many(
        self, peer_address: bytes, pieces: list[tuple[int, torch.Tensor]], timeout: float
    ) -> None:
        peer = self._network.planes.get(peer_address)
        try:
            if peer is None:
                raise KVTransferError("unknown peer")
            await asyncio.wait_for(
                asyncio.gather(*(peer._deliver(tag, buf) for tag, buf in pieces)), timeout
            )
        except (KVTransferError, asyncio.TimeoutError) as err:
            self.counters.transfers_failed += 1
            raise KVTransferError(f"KV send (tag {pieces[0][0]:#x}) failed: {err!r}") from None
        self.counters.bytes_sent += sum(nbytes(buf) for _, buf in pieces)

    async def _deliver(self, tag: int, buffer: torch.Tensor) -> None:
        if isinstance(buffer, numpy.ndarray):  # from a helper's region (HelperServer)
            buffer = torch.from_numpy(buffer)
        while self.hold or tag not in self._posted:
            if not self.hold and tag not in self._posted:
                waiter = self._unexpected.setdefault(
                    tag, asyncio.get_running_loop().create_future()
                )
                await waiter
                continue
            await asyncio.sleep(0.01)
        dst, done = self._posted.pop(tag)
        if nbytes(buffer) > nbytes(dst):
            done.set_exception(KVTransferError("message truncated"))
            raise KVTransferError("message truncated")
        into = staging(dst) if isinstance(dst, list) else dst
        into.reshape(-1).view(torch.uint8)[: nbytes(buffer)].copy_(
            gathered(buffer).reshape(-1).view(torch.uint8)
        )
        if into is not dst:
            scatter(into, dst)
        done.set_result(nbytes(buffer))

    async def receive(self, tag: int, buffer: torch.Tensor) -> int:
        return await self.post_receives([(tag, buffer)])[0]

    def post_receives(self, pieces: list[tuple[int, torch.Tensor]]) -> list[asyncio.Future]:
        """Posted now, as UCX does: a release() right after ends them."""
        return [
            asyncio.ensure_future(self._receive(tag, self._post(tag, buf))) for tag, buf in pieces
        ]

    def _post(self, tag: int, buffer: torch.Tensor) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        if isinstance(buffer, list):  # spans to scatter over (a helper's: arrays of a region)
            buffer = [torch.from_numpy(b) if isinstance(b, numpy.ndarray) else b for b in buffer]
        elif isinstance(buffer, numpy.ndarray):  # discard()'s scratch, or a helper's region
            buffer = torch.from_numpy(buffer)
        self._posted[tag] = (buffer, done)
        waiter = self._unexpected.pop(tag, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return done

    async def _receive(self, tag: int, done: asyncio.Future) -> int:
        nbytes = await asyncio.shield(done)
        if nbytes is None:
            raise ReceiveReleased(f"KV receive (tag {tag:#x}) released before any data came")
        self.counters.bytes_received += nbytes
        return nbytes

    async def ready(self, timeout: float) -> bool:
        return True

    async def discard(self, pieces: list[tuple[int, int]], timeout: float) -> None:
        await discard(self, pieces, timeout)

    def restart(self) -> None:
        """What a helper plane's restart does: every posted receive fails, with PlaneRestarted."""
        for _, done in self._posted.values():
            if not done.done():
                done.set_exception(PlaneRestarted("the data-plane helper was replaced"))
        self._posted.clear()

    async def release(self, tags: list[int], timeout: float = 10.0) -> None:
        for tag in tags:
            posted = self._posted.pop(tag, None)
            if posted is not None and not posted[1].done():
                posted[1].set_result(None)
                self.counters.receives_released += 1
        await asyncio.sleep(0)
