"""UcxDataPlane: the KV data plane (shared.dataplane.plane.DataPlane) over ucxx.

The receiving (decode) side owns the destination buffer and posts a tagged receive into it;
the sending (prefill) side sends the packed KV with that tag to the receiver's UCX worker
address. Tags are 64-bit ids chosen by the receiver per transfer, so concurrent transfers
on one endpoint never mix. `InProcessDataPlane` (tests.fakes.dataplane) is the fake for unit tests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy

from shared.dataplane import ucx_info, ucx_progress, ucxx_compat
from shared.dataplane.abandoned import AbandonedSends
from shared.dataplane.plane import (
    KVTransferError,
    ReceiveReleased,
    TransferCounters,
    discard,
    gathered,
    nbytes,
    scatter,
)
from shared.dataplane.staging import StagingBuffers, landing
from shared.dataplane.ucx_views import ucx_view

if TYPE_CHECKING:  # the data-plane helper process runs this without torch
    import torch

log = logging.getLogger(__name__)

_EMPTY = numpy.zeros(0, dtype=numpy.uint8)  # what release() sends to end a posted receive


class UcxDataPlane:
    """The real data plane over ucxx. `async with UcxDataPlane(settings) as plane:`.

    UCX's shared-memory transports (sysv/posix for small messages, cma for large ones) cannot
    run in its peer-failure mode, so endpoints are opened without it unless `error_handling`
    is set (then UCX uses tcp even on one host). Dead peers are found by the transfer leases
    and worker heartbeats instead, and a failed endpoint is dropped and reopened.

    Without that mode, a peer that dies mid-transfer can make UCX use a freed endpoint, a
    segfault (docs/reliability.md, "A dead peer inside UCX"): workers run this plane in a helper process of
    their own (shared.dataplane.helper_plane), where that costs only the transfers in flight.

    Progress comes from the event loop (shared.dataplane.ucx_progress), not ucxx's thread: on a
    few cores that thread competed with the model, and a many-piece transfer ran at half speed.
    """

    gathers = False  # a piece is one contiguous buffer: KVSender gathers scattered blocks itself
    MAX_ENDPOINTS = 256
    MAX_RETIRED = 64  # endpoints of failed peers kept unclosed; older ones are let go

    def __init__(
        self,
        net_devices: str = "lo",
        tls: str = "",
        error_handling: bool = False,
        progress_mode: str = "blocking",
        rndv_scheme: str = "",
    ):
        options = {"NET_DEVICES": net_devices, "TLS": tls, "RNDV_SCHEME": rndv_scheme}
        self._options = {k: v for k, v in options.items() if v}  # empty: UCX's choice
        self._progress_mode = progress_mode
        self._error_handling = error_handling
        self._endpoints: OrderedDict[bytes, object] = OrderedDict()
        self._retired: list = []  # endpoints of failed peers, never closed (see forget)
        self._connecting: dict[bytes, asyncio.Lock] = {}
        self._posted: dict[int, object] = {}  # tag -> the UCX receive request posted with it
        self._completing: set[asyncio.Task] = set()
        self._verdicts: dict[int, asyncio.Future] = {}  # tag -> True when release() ended it empty
        # ucxx cannot cancel one posted request: a send that timed out may still be read, so its
        # buffers must outlive it (see AbandonedSends)
        self._abandoned = AbandonedSends()
        self._staging = StagingBuffers()  # host buffers a receive lands in before its scatter
        self.counters = TransferCounters()
        self.address = b""
        self._peer_transports: dict[bytes, str] = {}  # peer -> what UCX chose to reach it
        self._progress = None

    async def __aenter__(self) -> UcxDataPlane:
        ucxx_compat.check()  # an incompatible ucxx fails here, naming its version
        import ucxx

        self._ucxx = ucxx
        ucxx.init(
            options=self._options, env_takes_precedence=True, progress_mode=self._progress_mode
        )
        if self._progress_mode == "blocking":  # ours: ucxx's own spins a core after the first event
            self._progress = ucx_progress.install(asyncio.get_running_loop())
        self.address = ucxx_compat.worker_address()
        log.info(
            "UCX data plane up: ucxx %s, UCX %s, options %s, %s progress, peer-failure mode %s, transports %s",
            ucxx_compat.version(),
            ".".join(map(str, ucxx.get_ucx_version())),
            self._options,
            self._progress_mode,
            "on (tcp only)" if self._error_handling else "off (shared memory on one host)",
            ucx_info.active_transports(ucxx),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self._posted:
            await self.release(list(self._posted))
        # Not closed: closing one whose peer is gone blocks until UCX gives up (see forget), and
        # which peers are gone is not known here. The process's exit ends them all.
        for peer_address in list(self._endpoints):
            self.forget(peer_address)
        if self._abandoned:
            log.warning("%d abandoned KV send(s) at shutdown", len(self._abandoned))

    def _done(self, request):
        """Awaitable end of a UCX request: from our progress driver, or ucxx's own wait."""
        return self._progress.done(request) if self._progress is not None else request.wait()

    def transports(self) -> str:
        return ",".join(sorted(set(self._peer_transports.values())))

    async def _endpoint(self, peer_address: bytes):
        ep = self._endpoints.get(peer_address)
        if ep is not None and not ep.closed:
            self._endpoints.move_to_end(peer_address)
            return ep
        lock = self._connecting.setdefault(peer_address, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(peer_address)
            if ep is None or ep.closed:
                ep = await self._ucxx.create_endpoint_from_worker_address(
                    ucxx_compat.address(peer_address),
                    endpoint_error_handling=self._error_handling,
                )
                self._endpoints[peer_address] = ep
                self._note_transport(peer_address, ep)
                while (
                    len(self._endpoints) > self.MAX_ENDPOINTS
                ):  # peers that restarted have new addresses
                    self.forget(next(iter(self._endpoints)))
            self._connecting.pop(peer_address, None)
            return ep

    def _note_transport(self, peer_address: bytes, ep) -> None:
        """Logs, and keeps for the heartbeat, the transports UCX chose for this peer."""
        if peer_address == self.address:
            return
        lanes = ucx_info.endpoint_lanes(ep.ucp_endpoint)
        summary = ucx_info.transport_summary(lanes)
        self._peer_transports[peer_address] = summary
        log.info(
            "KV endpoint to peer %s: %s (lanes: %s)",
            peer_address[:8].hex(),
            summary,
            "; ".join(lanes) or "?",
        )
        if summary.startswith("tcp") and not self._error_handling:
            log.warning(
                "KV bytes to peer %s go over %s: not shared memory (another host, or UCX could not use "
                "sysv/posix/cma here)",
                peer_address[:8].hex(),
                summary,
            )

    def transport_to(self, peer_address: bytes) -> str:
        return self._peer_transports.get(peer_address, "")

    def forget(self, peer_address: bytes) -> None:
        """Drops the endpoint to a peer (it failed, or the peer left); the next send reopens it.

        It is retired, not closed: closing one whose peer is gone blocks until UCX gives up, and
        in blocking progress mode nothing else runs meanwhile (nor may it be garbage-collected,
        whose finalizer closes it the same way)."""
        ep = self._endpoints.pop(peer_address, None)
        if ep is not None:
            ucx_info.never_close(ep)
            self._retired.append(ep)
            del self._retired[: -self.MAX_RETIRED]  # its finalizer is detached: dropping it
            self._peer_transports.pop(peer_address, None)  # closes nothing, blocks on nothing

    async def send(
        self, peer_address: bytes, tag: int, buffer: torch.Tensor, timeout: float
    ) -> None:
        await self.send_many(peer_address, [(tag, buffer)], timeout)

    async def send_many(
        self, peer_address: bytes, pieces: list[tuple[int, torch.Tensor]], timeout: float
    ) -> None:
        """Puts every (tag, buffer) on the wire at once (one UCX request each, no task per piece)
        and waits for all of them, `timeout` in all."""
        requests = []
        try:
            ep = await self._endpoint(peer_address)
            # The views stay alive until every send completes.
            views, requests = ucxx_compat.tag_sends(
                ep, [ucx_view(gathered(buf)) for _, buf in pieces], [tag for tag, _ in pieces]
            )
            await asyncio.wait_for(asyncio.gather(*(self._done(r) for r in requests)), timeout)
        except Exception as err:
            self.counters.transfers_failed += 1
            self._abandoned.keep(requests, [buf for _, buf in pieces])
            self.forget(peer_address)
            raise KVTransferError(
                f"KV send of {len(pieces)} piece(s) (tag {pieces[0][0]:#x}...) failed: {err!r}"
            ) from err
        self.counters.bytes_sent += sum(nbytes(buf) for _, buf in pieces)

    async def receive(self, tag: int, buffer: torch.Tensor) -> int:
        return await self.post_receives([(tag, buffer)])[0]

    def post_receives(self, pieces: list[tuple[int, torch.Tensor]]) -> list[asyncio.Future]:
        """Posts a receive per (tag, buffer) now (a list of spans: into one staging buffer,
        scattered over them once it landed); each future gives the byte count, or raises
        KVTransferError when the receive failed or release() ended it before data came."""
        loop = asyncio.get_running_loop()
        entries = []
        for tag, buf in pieces:
            into, staged = landing(self._staging, buf) if isinstance(buf, list) else (buf, None)
            view = ucxx_compat.buffer(ucx_view(into))
            request = ucxx_compat.tag_recv(view, tag)
            self._posted[tag] = request
            entries.append((tag, request, loop.create_future(), view, into, buf, staged))
        task = asyncio.ensure_future(self._complete(entries))
        self._completing.add(task)
        task.add_done_callback(self._completing.discard)
        return [entry[2] for entry in entries]

    async def _complete(self, entries: list) -> None:
        """Resolves the futures of posted receives as their requests complete (in posting order)."""
        for tag, request, future, _, into, buf, staged in entries:
            size = nbytes(buf)
            try:
                await self._done(request)
                error = None
            except Exception as err:  # e.g. the peer died mid-message
                error = KVTransferError(f"KV receive (tag {tag:#x}) failed: {err!r}")
            self._posted.pop(tag, None)
            verdict = self._verdicts.pop(tag, None)
            if error is None and verdict is not None and await verdict:
                error = ReceiveReleased(f"KV receive (tag {tag:#x}) released before any data came")
            if error is not None:
                if verdict is None:  # a failure, not a release
                    self.counters.transfers_failed += 1
                future.set_exception(error)
                future.exception()  # retrieved: a released receive is expected, not an error to log
            else:
                if into is not buf:
                    scatter(into, buf)
                self.counters.bytes_received += size
                future.set_result(size)
            if staged is not None:
                self._staging.give(staged)  # the request is over: UCX writes there no more

    async def ready(self, timeout: float) -> bool:
        return True

    async def discard(self, pieces: list[tuple[int, int]], timeout: float) -> None:
        await discard(self, pieces, timeout)

    async def release(self, tags: list[int], timeout: float = 10.0) -> None:
        """Ends open receives by sending each an empty message from this worker to itself; a
        receive that data matched first leaves that message unmatched, and it is swept up here."""
        posted = {
            tag: self._posted[tag]
            for tag in tags
            if tag in self._posted and not self._posted[tag].completed
        }
        if not posted:
            return
        loop = asyncio.get_running_loop()
        verdicts = {tag: loop.create_future() for tag in posted}
        self._verdicts.update(verdicts)
        try:
            own, deadline = await self._endpoint(self.address), loop.time() + timeout
            sends = asyncio.gather(*(own.send(_EMPTY, tag=tag, force_tag=True) for tag in posted))
            try:
                await asyncio.wait_for(sends, timeout)
            except asyncio.TimeoutError:  # our own queue is full: those receives stay open
                log.warning("%d KV receive(s): messages to end them did not go", len(posted))
            while not all(r.completed for r in posted.values()) and loop.time() < deadline:
                await asyncio.sleep(0.001)
        finally:
            for tag, verdict in verdicts.items():
                if not posted[tag].completed:  # matched by a sender that never finished: still open
                    continue
                # Ours, or the late data itself, taken off the wire. Our empty message still
                # waiting means data came first; else ours ended the receive.
                empty = await ucxx_compat.take_message(tag) != 0
                self.counters.receives_released += empty
                if not verdict.done():
                    verdict.set_result(empty)
