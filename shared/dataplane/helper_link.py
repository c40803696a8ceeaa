"""HelperLink: the worker's end of its data-plane helper process (shared.dataplane.helper). It
starts the helper with the shared regions, carries commands and their replies, and keeps one
helper running: a helper that exits (a crash inside UCX) or stops answering pings for `hang_s`
is replaced, with back-off, and `on_lost` is told first so its transfers fail at once.
"""

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.dataplane.helper_wire import HelperGone, frame, read_frame
from shared.dataplane.plane import KVTransferError, PlaneRestarted, TransferCounters
from shared.engine.shared_region import SharedRegion

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]  # where `shared` is importable from
# A helper that failed to start is tried again after FIRST_RETRY_S, then twice as long each time
# up to MAX_RETRY_S: a machine out of something (memory, ports) is not hammered.
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 10.0


@dataclass(frozen=True)
class HelperTiming:
    """How long the worker gives its helper (WorkerSettings' kv_helper_* settings)."""

    start_s: float = 120.0  # to start and say it is ready (import UCX, map the pool)
    hang_s: float = 10.0  # to answer a ping, or to exit when told; silent longer: replaced
    ping_s: float = 1.0  # between two pings


class HelperLink:
    def __init__(
        self,
        regions: list[SharedRegion],
        options: list[str],
        counters: TransferCounters,
        on_event: Callable[[dict], None],
        on_lost: Callable[[KVTransferError], None],
        timing: HelperTiming = HelperTiming(),
    ):
        self.regions, self.options, self.counters = regions, options, counters
        self.on_event, self.on_lost = on_event, on_lost
        self.timing = timing
        self.address = b""
        self.up = asyncio.Event()
        self.process = None
        self._writer = None
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}
        self._supervisor = None
        self._reader = None  # the task reading the helper up now (held: tasks are weakly kept)
        self._closing = False

    async def __aenter__(self) -> "HelperLink":
        await self._start()
        self._supervisor = asyncio.create_task(self._supervise())
        return self

    async def __aexit__(self, *exc) -> None:
        self._closing = True
        self._supervisor.cancel()
        await asyncio.gather(self._supervisor, return_exceptions=True)
        self.up.clear()
        if self._writer is not None:
            self._writer.close()  # the helper ends its receives and exits at the socket's end
        await self._reap(self.process, timeout=self.timing.hang_s)

    async def _start(self) -> None:
        parent, child = socket.socketpair()
        args = ["--socket-fd", str(child.fileno())]
        args += [arg for r in self.regions for arg in ("--region", f"{r.fd}:{r.nbytes}")]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "shared.dataplane.helper", *args, *self.options,
                pass_fds=[child.fileno(), *(r.fd for r in self.regions)],
                stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=path),
            )  # fmt: skip
        finally:
            child.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=parent)
        try:
            ready = await asyncio.wait_for(read_frame(reader), self.timing.start_s)
        except (HelperGone, asyncio.TimeoutError) as err:
            self.process.kill()
            raise KVTransferError(f"the KV data-plane helper did not start: {err!r}") from None
        self.address = ready["address"]
        self._reader = asyncio.create_task(self._read(reader, self.process))
        self.up.set()
        log.info(
            "KV data-plane helper up: pid %d, UCX address %s",
            self.process.pid,
            self.address[:8].hex(),
        )

    async def _read(self, reader, process) -> None:
        try:
            while True:
                message = await read_frame(reader)
                if message.get("ev") == "reply":
                    future = self._replies.pop(message["id"], None)
                    if future is not None and not future.done():
                        future.set_result(message)
                else:
                    self.on_event(message)
        except HelperGone:
            pass
        finally:
            if process is self.process and not self._closing:
                self._lost(process)

    def _lost(self, process) -> None:
        self.up.clear()
        error = PlaneRestarted(
            f"the KV data-plane helper (pid {process.pid}) exited: its transfers in flight are lost"
        )
        replies, self._replies = list(self._replies.values()), {}
        for future in replies:
            if not future.done():
                future.set_exception(error)
        self.on_lost(error)

    async def _supervise(self) -> None:
        backoff = FIRST_RETRY_S
        while True:
            if self.up.is_set():
                backoff = FIRST_RETRY_S
                await asyncio.sleep(self.timing.ping_s)
                await self._ping()
                continue
            await self._reap(self.process, timeout=self.timing.hang_s)
            try:
                await self._start()
                self.counters.plane_restarts += 1
            except (KVTransferError, OSError) as err:
                log.error("KV data-plane helper restart failed (again in %.1fs): %s", backoff, err)
                await asyncio.sleep(backoff)
                backoff = min(MAX_RETRY_S, backoff * 2)

    async def _ping(self) -> None:
        try:
            await self.request({"op": "ping"}, self.timing.hang_s)
        except asyncio.TimeoutError:
            log.error("KV data-plane helper silent for %.0fs: replacing it", self.timing.hang_s)
            self.kill()
        except KVTransferError:
            pass  # it died meanwhile: the supervisor starts another

    async def _reap(self, process, timeout: float) -> None:
        if process is None:
            return
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
        if process.returncode:
            log.warning(
                "KV data-plane helper pid %d ended with %d", process.pid, process.returncode
            )

    def kill(self) -> None:
        """Ends the helper now (the supervisor starts another)."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    def post(self, message: dict) -> None:
        """Sends a command that has no reply."""
        if not self.up.is_set():
            raise PlaneRestarted("the KV data-plane helper is restarting")
        self._writer.write(frame(message))

    async def request(self, message: dict, timeout: float) -> dict:
        """Sends a command and waits for its reply."""
        if not self.up.is_set():
            raise PlaneRestarted("the KV data-plane helper is restarting")
        message["id"] = request_id = next(self._ids)
        future = self._replies[request_id] = asyncio.get_running_loop().create_future()
        self._writer.write(frame(message))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._replies.pop(request_id, None)
