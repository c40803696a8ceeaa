"""KVSender: one prompt's KV, sent by the prefill worker a segment at a time as it is computed.

A piece (whole blocks, every layer; see plan.py) whose blocks are consecutive in this
pool too (the block allocator hands out consecutive runs when it can) is sent straight from the
pool: no copy on either side. Any other piece is gathered once into a buffer of its own (the one
copy on this side), in the engine thread between steps. The pieces of a segment go out
concurrently, each straight into the decode pool range the plan names. The prompt's blocks
must stay held until `finish` returns.
"""

import asyncio
import time
from dataclasses import dataclass, field

import torch

from shared.dataplane.plane import DataPlane, KVTransferError, nbytes
from shared.engine.kv_cache import KVPool
from shared.kvtransfer.plan import Piece, Segment, TransferPlan, head_slice


@dataclass
class Staged:
    """A segment ready to go: views of the pool, and the blocks of pieces still to be gathered."""

    segment: Segment
    direct: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    scattered: list[tuple[int, Piece, list[int]]] = field(default_factory=list)


class KVSender:
    def __init__(self, plane: DataPlane, pools: list[KVPool], plan: TransferPlan, timeout_s: float):
        self.plane = plane
        self.pools = pools  # each rank's
        self.plan = plan
        self.timeout_s = timeout_s
        self.next_segment = 0  # the first segment not staged yet
        self.pieces_sent = 0  # [0, pieces_sent) may be on the wire (drained on abort)
        self.bytes_sent = 0
        self.first_sent_at = 0.0  # unix time the first piece was handed to the plane
        self.sends: list[asyncio.Task] = []

    @property
    def all_staged(self) -> bool:
        return self.next_segment == len(self.plan.segments)

    def ready(self, computed_tokens: int) -> list[Segment]:
        """Segments whose every token is computed and that are not staged yet."""
        out = []
        for seg in self.plan.segments[self.next_segment :]:
            if seg.end > computed_tokens:
                break
            out.append(seg)
        return out

    def stage(self, segment: Segment, block_table: list[int]) -> Staged:
        """Engine thread, no copy: views of the sending rank's pool for the pieces that are one
        run of blocks here (a strided slice of their heads only where the plane gathers it), and
        the blocks of the others, to be gathered (`gather`) while the first travel."""
        staged = Staged(segment)
        bs = self.pools[0].block_size
        for p in segment.pieces:
            blocks = block_table[p.start // bs : p.start // bs + p.blocks]
            if blocks == list(range(blocks[0], blocks[0] + p.blocks)):
                view = self._heads(p, self.pools[p.rank].blocks(blocks[0], p.blocks))
                if view.is_contiguous() or self.plane.gathers:
                    staged.direct.append((self.plan.tag(p), view))
                    continue
            staged.scattered.append((self.plan.tag(p), p, blocks))
        self.next_segment = segment.index + 1
        return staged

    def _heads(self, piece: Piece, blocks: torch.Tensor) -> torch.Tensor:
        return head_slice(blocks, piece.route.source_offset, piece.route.heads)

    def gather(self, staged: Staged) -> list[tuple[int, torch.Tensor | list[torch.Tensor]]]:
        """Engine thread: the one copy on this side, of the pieces whose blocks are not
        consecutive or whose heads are a slice of the sending rank's; for a plane that gathers
        (`DataPlane.gathers`, in its helper process), the views of each run of them instead."""
        if self.plane.gathers:
            return [(tag, self._runs(p, blocks)) for tag, p, blocks in staged.scattered]
        out = []
        for tag, p, blocks in staged.scattered:
            kv = self.pools[p.rank].kv
            picked = kv.index_select(0, torch.tensor(blocks, device=kv.device))
            out.append((tag, self._heads(p, picked).contiguous()))
        if out and self.pools[0].kv.is_cuda:  # UCX reads them on its own streams: copies land
            torch.cuda.current_stream().synchronize()
        return out

    def _runs(self, piece: Piece, blocks: list[int]) -> list[torch.Tensor]:
        """The pool views of runs of consecutive blocks, in order (their route's heads)."""
        runs, start, pool = [], 0, self.pools[piece.rank]
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                runs.append(self._heads(piece, pool.blocks(blocks[start], i - start)))
                start = i
        return runs

    def send(self, sources: list[tuple[int, torch.Tensor]]) -> asyncio.Task | None:
        """Puts pieces on the wire; the task ends when all have left."""
        if not sources:
            return None
        self.first_sent_at = self.first_sent_at or time.time()
        self.pieces_sent = max(
            self.pieces_sent, max(tag for tag, _ in sources) - self.plan.destination.base_tag + 1
        )
        task = asyncio.create_task(self._send_all(sources))
        self.sends.append(task)
        return task

    async def _send_all(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        await self.plane.send_many(self.plan.destination.ucx_address, pieces, self.timeout_s)
        self.bytes_sent += sum(nbytes(b) for _, b in pieces)

    async def finish(self) -> None:
        """Waits for every segment put on the wire; raises KVTransferError if any piece failed."""
        results = await asyncio.gather(*self.sends, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise (
                errors[0]
                if isinstance(errors[0], KVTransferError)
                else KVTransferError(repr(errors[0]))
            )
