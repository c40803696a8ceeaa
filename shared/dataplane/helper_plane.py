"""HelperDataPlane: the KV data plane (shared.dataplane.plane.DataPlane) with UCX in a helper
process of the worker's own (shared.dataplane.helper), so that a crash inside UCX costs the
transfers in flight, never the worker.

The worker's KV pool lives in a SharedRegion both processes map; the worker names buffers by
region and offset (shared.dataplane.helper_wire) and the helper's UCX reads and writes them in
place: no copy is added. Pieces whose blocks are scattered are handed over as the list of their
runs of pool blocks (`gathers`), and the helper gathers them, off the worker's threads.

When the helper dies, every transfer it carried fails with KVTransferError; the receives it had
posted cannot write any more, so their blocks are free at once. A new helper starts (with a new
UCX address, which heartbeats and KV destinations carry from then on). A helper that stops
answering for `hang_s` is killed and replaced the same way.
"""

import asyncio
import logging

import numpy

from shared.dataplane.helper_link import HelperLink, HelperTiming
from shared.dataplane.helper_wire import ASSEMBLE, LANDED, RELEASED, strided_ref
from shared.dataplane.plane import (
    Assembly,
    KVTransferError,
    PlaneRestarted,
    ReceiveReleased,
    TransferCounters,
    contiguous,
    nbytes,
)
from shared.engine.shared_region import SharedRegion, locate

log = logging.getLogger(__name__)


class HelperDataPlane:
    """`async with HelperDataPlane([pool_region], ...) as plane:` the same contract as UcxDataPlane."""

    gathers = True  # KVSender hands it the spans of a scattered piece, not a gathered copy

    def __init__(
        self,
        regions: list[SharedRegion],
        net_devices: str = "lo",
        tls: str = "",
        error_handling: bool = False,
        progress_mode: str = "blocking",
        rndv_scheme: str = "",
        timing: HelperTiming | None = None,  # None: HelperTiming's defaults
    ):
        timing = timing or HelperTiming()
        self.regions = regions
        options = ["--net-devices", net_devices, "--progress-mode", progress_mode]
        options += ["--tls", tls, "--rndv-scheme", rndv_scheme]
        options += ["--error-handling"] if error_handling else []
        options += ["--log-level", logging.getLevelName(logging.getLogger().level)]
        self.counters = TransferCounters()
        self._receives: dict[int, asyncio.Future] = {}  # tag -> its posted receive
        self._transports: dict[bytes, str] = {}
        self._link = HelperLink(
            regions, options, self.counters, self._on_event, self._on_lost, timing
        )
        # beyond an operation's own timeout, for the helper to answer: as long as a ping may take
        # (a helper silent longer is replaced, and the operation fails then anyway)
        self._grace_s = timing.hang_s

    async def __aenter__(self) -> "HelperDataPlane":
        await self._link.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._link.__aexit__(*exc)

    @property
    def address(self) -> bytes:
        """The UCX address of the helper up now (a new one after each restart)."""
        return self._link.address

    @property
    def helper_pid(self) -> int:
        return self._link.process.pid if self._link.process is not None else 0

    async def ready(self, timeout: float) -> bool:
        """Whether a helper is up, waiting up to `timeout` for one (after a restart, with its new
        address)."""
        try:
            await asyncio.wait_for(self._link.up.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _on_event(self, message: dict) -> None:
        if message.get("ev") == "landed":
            for tag, size, outcome, detail in message["items"]:
                self._settle(tag, size, outcome, detail)

    def _settle(self, tag: int, size: int, outcome: int, detail: str) -> None:
        future = self._receives.pop(tag, None)
        if future is None or future.done():
            return
        if outcome == LANDED:
            self.counters.bytes_received += size
            future.set_result(size)
            return
        if outcome == RELEASED:
            self.counters.receives_released += 1
            future.set_exception(ReceiveReleased(detail))
        else:
            self.counters.transfers_failed += 1
            future.set_exception(KVTransferError(detail))
        future.exception()  # retrieved: its owner sees it through its own callback

    def _on_lost(self, error: KVTransferError) -> None:
        """The helper is gone: its receives fail, and none of them can write any more."""
        receives, self._receives = list(self._receives.values()), {}
        log.error("%s (%d receive(s) open)", error, len(receives))
        self.counters.transfers_failed += len(receives)
        for future in receives:
            if not future.done():
                future.set_exception(error)
                future.exception()

    def _ref(self, buffer) -> list:
        if isinstance(buffer, list):  # spans the helper gathers into one message
            return [self._ref(part) for part in buffer]
        if isinstance(buffer, Assembly):  # a piece the helper puts together from its parts
            parts = [[o, shape, strides, self._ref(v)] for o, shape, strides, v in buffer.parts]
            return [ASSEMBLE, buffer.nbytes, parts]
        if isinstance(buffer, numpy.ndarray):
            address, itemsize = buffer.ctypes.data, buffer.itemsize
            shape, strides = list(buffer.shape), [s // itemsize for s in buffer.strides]
        else:  # a torch.Tensor (torch is imported where the pool is made, not here)
            address, itemsize = buffer.data_ptr(), buffer.element_size()
            shape, strides = list(buffer.shape), list(buffer.stride())
        if contiguous(buffer):
            return [*locate(self.regions, address, buffer.nbytes), buffer.nbytes]
        return strided_ref(self.regions, address, itemsize, shape, strides)

    # -- the DataPlane contract

    def transports(self) -> str:
        return ",".join(sorted({t for t in self._transports.values() if t}))

    def transport_to(self, peer_address: bytes) -> str:
        return self._transports.get(peer_address, "")

    async def send(self, peer_address: bytes, tag: int, buffer, timeout: float) -> None:
        await self.send_many(peer_address, [(tag, buffer)], timeout)

    async def send_many(self, peer_address: bytes, pieces: list, timeout: float) -> None:
        await self.ready(timeout)  # a helper restarting: within the send's own time
        try:
            refs = [[tag, self._ref(buf)] for tag, buf in pieces]
            message = {"op": "send", "peer": peer_address, "pieces": refs, "timeout": timeout}
            reply = await self._link.request(message, timeout + self._grace_s)
            if "error" in reply:
                raise KVTransferError(reply["error"])
        except (KVTransferError, ValueError, asyncio.TimeoutError) as err:
            self.counters.transfers_failed += 1
            kind = PlaneRestarted if isinstance(err, PlaneRestarted) else KVTransferError
            raise kind(f"KV send of {len(pieces)} piece(s) failed: {err}") from None
        self._transports[peer_address] = reply.get("transport", "")
        self.counters.bytes_sent += sum(nbytes(buf) for _, buf in pieces)

    async def receive(self, tag: int, buffer) -> int:
        return await self.post_receives([(tag, buffer)])[0]

    def post_receives(self, pieces: list) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in pieces]
        try:
            refs = [[tag, self._ref(buf)] for tag, buf in pieces]
            self._link.post({"op": "recv", "pieces": refs})
        except (KVTransferError, ValueError) as err:
            kind = PlaneRestarted if isinstance(err, PlaneRestarted) else KVTransferError
            for future in futures:
                future.set_exception(kind(f"KV receive not posted: {err}"))
            return futures
        for (tag, _), future in zip(pieces, futures):
            self._receives[tag] = future
        return futures

    async def release(self, tags: list[int], timeout: float = 10.0) -> None:
        """As UcxDataPlane's; but a receive a dead peer matched, which UCX never ends, is ended by
        replacing the helper (its other transfers in flight fail): no block stays quarantined."""
        open_tags = [tag for tag in tags if tag in self._receives]
        if not open_tags:
            return
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            message = {"op": "release", "tags": open_tags, "timeout": timeout}
            await self._link.request(message, timeout + self._grace_s)
        except (KVTransferError, asyncio.TimeoutError) as err:
            log.warning("%d KV receive(s) not released: %s", len(open_tags), err)
        stuck = [self._receives[tag] for tag in open_tags if tag in self._receives]
        if stuck:  # their outcomes may still be on the way
            await asyncio.wait(
                stuck, timeout=max(0.1, deadline - asyncio.get_running_loop().time())
            )
        stuck = [future for future in stuck if not future.done()]
        if stuck and self._link.up.is_set():
            log.warning(
                "%d KV receive(s) matched by a peer that never finished: replacing the data-plane "
                "helper to end them",
                len(stuck),
            )
            self._link.kill()
            await asyncio.wait(stuck, timeout=self._link.timing.hang_s)

    async def discard(self, pieces: list[tuple[int, int]], timeout: float) -> None:
        if not pieces:
            return
        try:
            message = {"op": "discard", "pieces": pieces, "timeout": timeout}
            await self._link.request(message, timeout + self._grace_s)
        except (KVTransferError, asyncio.TimeoutError) as err:
            log.warning("%d unwanted KV message(s) not discarded: %s", len(pieces), err)
