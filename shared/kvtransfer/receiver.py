"""KVReceiver: one prompt's KV, received by the decode worker straight into its pool blocks.

Every piece's receive is posted before the prefill worker is asked for the KV, into the pool
blocks the piece belongs to: a piece of one run lands where attention will read it, with no copy;
a piece of several runs (a connector that sends a segment as one message) is posted as the list
of its runs, and the transport scatters it there on landing. The blocks must not be freed while
a receive is posted into them, so an abort first ends every receive still open
(`DataPlane.release`) and only then lets the blocks go.
"""

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from shared.dataplane.plane import DataPlane, KVTransferError, PlaneRestarted
from shared.engine.kv_cache import KVPool
from shared.kvtransfer.plan import Piece, TransferPlan

log = logging.getLogger(__name__)


class TransferStalled(KVTransferError):
    """No piece landed for a whole lease."""


class KVReceiver:
    def __init__(self, plane: DataPlane, pools: list[KVPool], plan: TransferPlan):
        self.plane = plane
        self.pools = pools  # each rank's
        self.plan = plan
        self.landed = 0
        self.landed_bytes = 0
        self.last_progress = 0.0  # monotonic time a piece last landed
        self.first_landed = 0.0  # wall time the first piece landed
        self.last_landed = 0.0  # wall time the latest piece landed
        self.done = asyncio.Event()
        self._tasks: dict[int, asyncio.Future] = {}  # tag -> its posted receive
        self._failure: BaseException | None = None
        self._listener: Callable[[], None] = lambda: None

    def start(self, listener: Callable[[], None] | None = None) -> None:
        """Posts the receive of every piece (call before the prefill worker may send);
        `listener` is called each time one ends (landed, failed or released)."""
        self._listener = listener or self._listener
        pieces = [(self.plan.tag(p), self._buffer(p)) for p in self.plan.pieces]
        for (tag, _), future in zip(pieces, self.plane.post_receives(pieces)):
            future.add_done_callback(self._on_landed)
            self._tasks[tag] = future

    def _buffer(self, piece: Piece) -> torch.Tensor | list[torch.Tensor]:
        """Where a piece lands: its one run of the receiving rank's pool blocks (every head it
        holds), or the list of its runs."""
        pool = self.pools[piece.dest]
        views = [pool.blocks(run.first, run.blocks) for run in piece.runs]
        return views[0] if len(views) == 1 else views

    def _on_landed(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            if self._failure is None and not task.cancelled():
                self._failure = task.exception()
            self.done.set()
            self._listener()
            return
        self.landed += 1
        self.landed_bytes += task.result()
        self.last_progress = time.monotonic()
        self.last_landed = time.time()
        self.first_landed = self.first_landed or self.last_landed
        if self.landed == len(self.plan.pieces):
            self.done.set()
        self._listener()

    @property
    def complete(self) -> bool:
        return self.landed == len(self.plan.pieces)

    def check(self, lease_s: float) -> None:
        """Raises if a receive failed, or if the transfer started and then stalled for a lease."""
        if self._failure is not None:
            kind = PlaneRestarted if isinstance(self._failure, PlaneRestarted) else KVTransferError
            raise kind(f"a KV piece was not received: {self._failure!r}")
        if (
            self.last_progress
            and not self.complete
            and time.monotonic() - self.last_progress > lease_s
        ):
            raise TransferStalled(
                f"no KV piece landed for {lease_s:.0f}s "
                f"({self.landed}/{len(self.plan.pieces)} pieces in)"
            )

    async def abort(self, timeout_s: float) -> bool:
        """Ends every receive still posted; True when none can write into the pool any more."""
        open_tags = [tag for tag, task in self._tasks.items() if not task.done()]
        if open_tags:
            await self.plane.release(open_tags, timeout_s)
        pending = [t for t in self._tasks.values() if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            if still:
                log.error(
                    "%d KV receive(s) did not end after release; their blocks stay out of use",
                    len(still),
                )
                return False
        return True

    def unfilled(self, pieces_sent: int) -> list[tuple[int, int]]:
        """(tag, bytes) of pieces the sender put on the wire that an abort released before they landed."""
        out = []
        for piece in self.plan.pieces[:pieces_sent]:
            task = self._tasks[self.plan.tag(piece)]
            if (
                task.done()
                and not task.cancelled()
                and isinstance(task.exception(), KVTransferError)
            ):
                out.append((self.plan.tag(piece), self.plan.piece_bytes(piece)))
        return out
