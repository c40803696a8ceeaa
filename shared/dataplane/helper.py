"""`python -m shared.dataplane.helper`: the data-plane helper process. It owns the worker's UCX
(a UcxDataPlane) and moves KV in and out of the regions the worker shares with it, on the
worker's commands (shared.dataplane.helper_wire). UCX can crash its process when a peer dies
mid-transfer (docs/reliability.md, "A dead peer inside UCX"); here that costs the transfers in
flight, not the worker and the sequences it holds: the worker's HelperDataPlane sees the socket
close and starts a new helper. It runs without torch (numpy views of the regions), and exits when its worker does.
"""

import argparse
import asyncio
import ctypes
import logging
import math
import signal
import socket
import sys

import numpy
from numpy.lib.stride_tricks import as_strided

from shared.dataplane.helper_wire import (
    ASSEMBLE,
    FAILED,
    LANDED,
    RELEASED,
    HelperGone,
    frame,
    read_frame,
)
from shared.dataplane.plane import KVTransferError, ReceiveReleased, discard
from shared.dataplane.staging import StagingBuffers
from shared.dataplane.ucx import UcxDataPlane
from shared.engine.shared_region import SharedRegion

log = logging.getLogger("tandem.dataplane.helper")


class HelperServer:
    """Runs the worker's commands on the plane; replies and receive outcomes go back batched."""

    def __init__(self, plane: UcxDataPlane, regions: list[SharedRegion], writer):
        self.plane = plane
        self.regions = regions
        self.writer = writer
        self.tasks: set[asyncio.Task] = set()
        self.staging = StagingBuffers()  # pieces gathered before they are sent
        self._landed: list[list] = []

    def view(self, ref) -> numpy.ndarray:
        """A ref's bytes in its region: a view, strided for a strided ref."""
        region, offset, nbytes, *layout = ref
        if not layout:
            return self.regions[region].view(offset, nbytes)
        shape, strides = layout
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        base = self.regions[region].view(offset, extent)
        if math.prod(shape) != nbytes or min(shape, default=1) < 1 or min(strides) < 1:
            raise ValueError("a strided KV buffer of an inconsistent shape")
        return as_strided(base, shape, strides, writeable=True)

    def buffer(self, ref, staged: list[numpy.ndarray]) -> numpy.ndarray:
        """A ref's bytes to send: a view of a region as it lies, or an assembly's parts copied
        into a reused buffer (appended to `staged`)."""
        if ref and ref[0] == ASSEMBLE:
            return self.assemble(ref, staged)
        return self.view(ref)

    def assemble(self, ref, staged: list[numpy.ndarray]) -> numpy.ndarray:
        """An assembly's buffer: each part's bytes copied to its place (one copy of each)."""
        _, nbytes, parts = ref
        out = self.staging.take(nbytes)
        staged.append(out)
        for offset, shape, strides, source in parts:
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
            if offset < 0 or offset + extent > nbytes:
                raise ValueError("an assembly's part outside its buffer")
            place = as_strided(out[offset:], shape, strides, writeable=True)
            place[...] = self.view(source).reshape(shape)
        return out

    def pieces(self, refs: list, staged: list) -> list[tuple[int, numpy.ndarray]]:
        return [(tag, self.buffer(ref, staged)) for tag, ref in refs]

    def spans(self, ref) -> numpy.ndarray | list[numpy.ndarray]:
        """Where a receive lands: a view of a region (scattered into when strided), or the views
        it is scattered over."""
        if ref and isinstance(ref[0], list):
            return [self.view(part) for part in ref]
        return self.view(ref)

    async def serve(self, reader) -> None:
        self.writer.write(frame({"ev": "ready", "address": self.plane.address}))
        while True:
            try:
                message = await read_frame(reader)
            except HelperGone:
                return  # the worker closed the socket, or exited
            op = message.pop("op", "")
            if op == "recv":
                self.post(message["pieces"])
            else:
                task = asyncio.create_task(self.answer(op, message))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def answer(self, op: str, message: dict) -> None:
        reply = {"ev": "reply", "id": message.pop("id")}
        try:
            if op == "send":
                refs = message["pieces"]
                copies = any(not _plain(ref) for _, ref in refs)
                # a gather copies: in a thread (numpy lets go of the GIL), so UCX keeps moving
                staged: list[numpy.ndarray] = []
                pieces = (
                    await asyncio.to_thread(self.pieces, refs, staged)
                    if copies
                    else self.pieces(refs, staged)
                )
                await self._send(message, pieces, staged)
                reply["transport"] = self.plane.transport_to(message["peer"])
            elif op == "release":
                await self.plane.release(message["tags"], message["timeout"])
            elif op == "discard":
                await discard(self.plane, message["pieces"], message["timeout"])
            elif op == "ping":
                reply["transports"] = self.plane.transports()
            else:
                raise ValueError(f"unknown helper command {op!r}")
        except (KVTransferError, ValueError, KeyError, TypeError) as err:
            reply["error"] = str(err)
        self.writer.write(frame(reply))

    async def _send(self, message: dict, pieces: list, staged: list[numpy.ndarray]) -> None:
        """The pieces sent; their gathered copies reused once sent (a send that failed may
        still be read by UCX: its copies are never reused)."""
        try:
            await self.plane.send_many(message["peer"], pieces, message["timeout"])
        except BaseException:
            for buffer in staged:
                self.staging.drop(buffer)
            raise
        for buffer in staged:
            self.staging.give(buffer)

    def post(self, pieces: list) -> None:
        try:
            buffers = [(tag, self.spans(ref)) for tag, ref in pieces]
        except (ValueError, TypeError) as err:  # a ref outside its region: those fail, not this
            self._landed += [[tag, 0, FAILED, f"KV receive not posted: {err}"] for tag, _ in pieces]
            asyncio.get_running_loop().call_soon(self._flush)
            return
        futures = self.plane.post_receives(buffers)
        for (tag, _), future in zip(pieces, futures):
            future.add_done_callback(lambda f, tag=tag: self._on_landed(tag, f))

    def _on_landed(self, tag: int, future: asyncio.Future) -> None:
        error = KVTransferError("cancelled") if future.cancelled() else future.exception()
        if error is None:
            item = [tag, future.result(), LANDED, ""]
        else:
            released = isinstance(error, ReceiveReleased)
            item = [tag, 0, RELEASED if released else FAILED, str(error)]
        if not self._landed:
            asyncio.get_running_loop().call_soon(self._flush)
        self._landed.append(item)

    def _flush(self) -> None:
        items, self._landed = self._landed, []
        self.writer.write(frame({"ev": "landed", "items": items}))


def _plain(ref) -> bool:
    """[region, offset, nbytes]: sent as it lies, no copy."""
    return len(ref) == 3 and all(isinstance(v, int) for v in ref)


def die_with_parent() -> None:
    """The kernel kills this process when the worker that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the socket's end stops it instead


async def run(args) -> None:
    regions = [SharedRegion.attach(fd, nbytes) for fd, nbytes in args.region]
    sock = socket.socket(fileno=args.socket_fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    plane = UcxDataPlane(
        args.net_devices, args.tls, args.error_handling, args.progress_mode, args.rndv_scheme
    )
    async with plane:
        server = HelperServer(plane, regions, writer)
        await server.serve(reader)
        for task in list(server.tasks):
            task.cancel()


def region_arg(text: str) -> tuple[int, int]:
    fd, nbytes = text.split(":")
    return int(fd), int(nbytes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--region", type=region_arg, action="append", default=[])
    parser.add_argument("--net-devices", default="lo")
    parser.add_argument("--tls", default="")
    parser.add_argument("--error-handling", action="store_true")
    parser.add_argument("--progress-mode", default="blocking")
    parser.add_argument("--rndv-scheme", default="")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    die_with_parent()
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s kv-helper %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
