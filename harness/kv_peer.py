"""KVPeer: a process holding a KV pool that moves KV through the real data plane on command.

The KV benchmark and the data-plane integration tests run two of these, one on each side of a
transfer, so every byte crosses a real process boundary over real UCX, through the same
TransferPlan (cut by the connector the destination names), KVSender and KVReceiver the workers
use. The controlling process sends commands
over a pipe as msgpack maps (never pickles) and gets a map back. Times are wall-clock
(time.time()), comparable between processes of one host.
"""

import asyncio
import hashlib
import multiprocessing
import os
import time
from dataclasses import asdict

import msgpack
import torch

from shared.control.messages import KVDestination, KVLayout
from shared.dataplane.helper_plane import HelperDataPlane
from shared.dataplane.ucx import UcxDataPlane
from shared.engine.kv_cache import KVPool
from shared.kvtransfer.connector import connector
from shared.kvtransfer.plan import TransferPlan
from shared.kvtransfer.receiver import KVReceiver
from shared.kvtransfer.sender import KVSender


class _Peer:
    def __init__(self, plane: UcxDataPlane, pool: KVPool):
        self.plane = plane
        self.pool = pool
        self.receivers: dict[int, KVReceiver] = {}
        self.bare: dict[int, asyncio.Task] = {}

    def _plan(self, prompt_len: int, destination: dict) -> TransferPlan:
        """The plan of the connector the destination names (push unless it says)."""
        where = KVDestination(**destination)
        how = connector(where.connector, self.plane, [self.pool])
        return how.plan(self.pool.layout, prompt_len, where)

    async def op_address(self) -> dict:
        await self.plane.ready(timeout=60)  # a helper plane: the one up now, after any restart
        return {"address": self.plane.address}

    async def op_send(
        self,
        prompt_len: int,
        src_table: list[int],
        destination: dict,
        chunk_tokens: int = 0,
        chunk_delay_s: float = 0.0,
        timeout_s: float = 30.0,
    ) -> dict:
        """Sends a prompt's KV as a prefill worker would; chunk_delay_s stands in for the compute
        of each chunk_tokens-token chunk (0 = all computed already)."""
        plan = self._plan(prompt_len, destination)
        sender = KVSender(self.plane, [self.pool], plan, timeout_s)
        started = time.time()
        computed = (
            prompt_len
            if not chunk_tokens
            else min(prompt_len, destination.get("skip_tokens", 0) + chunk_tokens)
        )
        while not sender.all_staged:
            for seg in sender.ready(computed):
                staged = sender.stage(seg, src_table)
                sender.send(staged.direct)
                await asyncio.sleep(0)  # the direct pieces move while the others are gathered
                sender.send(sender.gather(staged))
            if not sender.all_staged:
                await asyncio.sleep(chunk_delay_s)
                computed = min(prompt_len, computed + chunk_tokens)
        computed_at = time.time()
        try:
            await sender.finish()
        except Exception as err:
            return {"ok": False, "error": repr(err), "pieces_sent": sender.pieces_sent}
        return {
            "ok": True,
            "started": started,
            "computed_at": computed_at,
            "finished": time.time(),
            "bytes": sender.bytes_sent,
            "pieces": len(plan.pieces),
            "transport": self.plane.transport_to(plan.destination.ucx_address),
        }

    async def op_receive(self, prompt_len: int, destination: dict) -> dict:
        plan = self._plan(prompt_len, destination)
        receiver = KVReceiver(self.plane, [self.pool], plan)
        receiver.start()
        await asyncio.sleep(0)  # the receives are posted
        self.receivers[plan.destination.base_tag] = receiver
        return {"pieces": len(plan.pieces), "bytes": plan.nbytes}

    async def op_wait(self, base_tag: int, timeout_s: float, lease_s: float = 30.0) -> dict:
        receiver = self.receivers[base_tag]
        deadline = time.monotonic() + timeout_s
        error = ""
        while not receiver.complete and time.monotonic() < deadline:
            try:
                receiver.check(lease_s)
            except Exception as err:
                error = repr(err)
                break
            try:
                await asyncio.wait_for(receiver.done.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        return {
            "complete": receiver.complete,
            "landed": receiver.landed,
            "bytes": receiver.landed_bytes,
            "first_landed": receiver.first_landed,
            "last_landed": receiver.last_landed,
            "error": error,
        }

    async def op_abort(self, base_tag: int, pieces_sent: int = -1, timeout_s: float = 10.0) -> dict:
        receiver = self.receivers.pop(base_tag)
        safe = await receiver.abort(timeout_s)
        unfilled = receiver.unfilled(pieces_sent) if pieces_sent >= 0 else []
        await self.plane.discard(unfilled, timeout_s)
        return {
            "safe": safe,
            "released": self.plane.counters.receives_released,
            "discarded": len(unfilled),
        }

    async def op_send_bare(
        self, address: bytes, tag: int, nbytes: int, timeout_s: float = 30.0
    ) -> dict:
        buffer = torch.ones(nbytes, dtype=torch.uint8, device=self.pool.device)
        _settled(buffer)
        started = time.time()
        await self.plane.send(address, tag, buffer, timeout_s)
        return {"started": started, "finished": time.time()}

    async def op_receive_bare(self, tag: int, nbytes: int) -> dict:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.pool.device)
        buffer.fill_(0)  # touch every page, as the pool's are
        _settled(buffer)
        self.bare[tag] = asyncio.ensure_future(self._bare(tag, buffer))
        await asyncio.sleep(0)
        return {}

    async def _bare(self, tag: int, buffer: torch.Tensor) -> float:
        await self.plane.receive(tag, buffer)
        return time.time()

    async def op_wait_bare(self, tag: int, timeout_s: float) -> dict:
        landed = await asyncio.wait_for(self.bare.pop(tag), timeout_s)
        return {"landed": landed}

    async def op_digest(self, table: list[int], start: int, end: int) -> dict:
        data = self.pool.export(self.pool.slots(table, start, end)).cpu().contiguous()
        return {"sha256": hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()}

    async def op_counters(self) -> dict:
        c = self.plane.counters
        return {
            "bytes_sent": c.bytes_sent,
            "bytes_received": c.bytes_received,
            "transfers_failed": c.transfers_failed,
            "receives_released": c.receives_released,
            "plane_restarts": c.plane_restarts,
            "helper_pid": getattr(self.plane, "helper_pid", 0),
            "transports": self.plane.transports(),
            "pid": os.getpid(),
        }


async def _serve(
    conn,
    layout: dict,
    num_blocks: int,
    seed: int,
    device: str,
    net_devices: str,
    error_handling: bool,
    progress_mode: str,
    helper: bool,
) -> None:
    layout = KVLayout(**layout)
    pool = KVPool(layout, num_blocks, layout.block_size, device, shared=helper)
    if seed:
        pool.kv.copy_(
            torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)).to(
                pool.kv.dtype
            )
        )
    else:
        pool.kv.fill_(0)
    options = dict(
        net_devices=net_devices, error_handling=error_handling, progress_mode=progress_mode
    )
    plane = HelperDataPlane([pool.region], **options) if helper else UcxDataPlane(**options)
    async with plane:
        peer = _Peer(plane, pool)
        loop = asyncio.get_running_loop()
        while True:
            request = msgpack.unpackb(await loop.run_in_executor(None, conn.recv_bytes), raw=False)
            op = request.pop("op")
            if op == "stop":
                conn.send_bytes(msgpack.packb({}))
                return
            try:
                reply = await getattr(peer, f"op_{op}")(**request)
            except Exception as err:
                reply = {"exception": repr(err)}
            conn.send_bytes(msgpack.packb(reply, use_bin_type=True))


def _main(conn, *args) -> None:
    torch.set_num_threads(1)
    asyncio.run(_serve(conn, *args))


def _settled(buffer: torch.Tensor) -> None:
    """UCX reads and writes a CUDA buffer on streams of its own: the fill must have landed."""
    if buffer.is_cuda:
        torch.cuda.current_stream().synchronize()


class KVPeer:
    """The controlling side: `with KVPeer(layout, num_blocks) as peer: peer.call("address")`."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        seed: int = 0,
        device: str = "cpu",
        net_devices: str = "lo",
        error_handling: bool = False,
        progress_mode: str = "blocking",
        helper: bool = False,  # the data plane in a helper process (HelperDataPlane)
    ):
        self._args = (
            asdict(layout),
            num_blocks,
            seed,
            device,
            net_devices,
            error_handling,
            progress_mode,
            helper,
        )
        self.process = None
        self._conn = None

    def __enter__(self) -> "KVPeer":
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child, *self._args), daemon=True)
        self.process.start()
        child.close()
        return self

    def __exit__(self, *exc) -> None:
        if self.process.is_alive():
            try:
                self.call("stop", wait_s=10)
            except Exception:
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def start(self, op: str, **args) -> None:
        self._conn.send_bytes(msgpack.packb({"op": op, **args}, use_bin_type=True))

    def result(self, wait_s: float = 60.0) -> dict:
        if not self._conn.poll(wait_s):
            raise TimeoutError(f"KV peer gave no answer in {wait_s}s")
        reply = msgpack.unpackb(self._conn.recv_bytes(), raw=False)
        if "exception" in reply:
            raise RuntimeError(f"KV peer failed: {reply['exception']}")
        return reply

    def call(self, op: str, wait_s: float = 60.0, **args) -> dict:
        self.start(op, **args)
        return self.result(wait_s)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
