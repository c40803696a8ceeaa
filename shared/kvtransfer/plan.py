"""TransferPlan: how one prompt's KV is cut into messages, computed alike on both ends.

Both workers derive the same plan from the PrefillTask's KVDestination (its connector names how
pieces are cut), so no per-message control traffic is needed: piece i travels with tag
`base_tag + i` and has a known size.

The pools are block-major (shared.engine.kv_cache): a run of consecutive decode blocks holds
every layer's keys and values of its positions as one contiguous range. Segments are fixed
ranges of token positions, whole blocks each; a segment is sent as soon as the prefill has
computed all its tokens (chunk-wise pipelining). Each piece names, for one segment, its routes
(which prefill ranks' KV heads, into which decode rank) and the runs of decode blocks it fills: a
piece of one run lands in the decode pool directly; a piece of several runs is scattered there on
landing. The last block of a prompt travels whole: its positions past the prompt hold whatever
the prefill pool had there, which the decode worker overwrites as it generates and never reads
before.

Between tensor-parallel groups (the destination names both degrees) each segment is cut per
decode rank: a piece fills whole blocks of one decode rank's pool (every KV head that rank holds),
from the routes (shared.parallel.heads.routes) that feed it: prefill ranks' runs of heads. Each
rank's pool holds only its own heads, so a piece whose routes are not one prefill rank's whole
blocks (degrees that differ, replicated heads) is assembled on the sending side, once: a strided
slice of one rank's blocks, or the head ranges of several ranks' blocks interleaved. The sending
worker's data plane maps every one of its ranks' pools, so it assembles there, overlapped with
the pieces already travelling; the receiving side always lands a piece in place.
"""

from collections.abc import Callable
from dataclasses import dataclass

from shared.control.messages import KVDestination, KVLayout
from shared.engine.kv_cache import bytes_per_token
from shared.parallel.heads import HeadSplit, Route, TPError, routes

TAG_BITS = 24  # low bits of a tag: the piece index
MAX_PIECES = 1 << TAG_BITS


class PlanError(ValueError):
    """A destination that does not fit the prompt or the layout."""


@dataclass(frozen=True)
class Run:
    """Consecutive blocks of the decode pool: the first and how many."""

    first: int
    blocks: int


@dataclass(frozen=True)
class Piece:
    index: int  # tag = base_tag + index
    segment: int
    start: int  # token positions [start, end) of the prompt; start is a block's first
    end: int
    runs: tuple[Run, ...]  # the decode blocks it fills, in token order
    routes: tuple[Route, ...]  # into one decode rank, by head: every head that rank holds
    whole: bool = True  # one prefill rank's blocks as they are (it holds just these heads)

    @property
    def blocks(self) -> int:
        return sum(run.blocks for run in self.runs)

    @property
    def dest(self) -> int:
        """The receiving rank."""
        return self.routes[0].dest

    @property
    def heads(self) -> tuple[int, int]:
        """The KV heads [first, end) it carries (the model's numbering)."""
        return self.routes[0].first, self.routes[-1].end


@dataclass(frozen=True)
class Segment:
    index: int
    start: int
    end: int
    pieces: tuple[Piece, ...]


def segment_tokens(configured: int, pool_device: str) -> int:
    """The segment size a decode worker asks for: `configured`, or (0) its pool's default. A
    segment is at least one piece, and a piece costs tens of microseconds of Python and UCX
    however small it is: on a CPU a fraction of copying a 1024-token segment, on a GPU (an H200,
    cuda_ipc) many times the copy of one. There a segment stays as long as a prompt until the
    block-major pieces are measured there (see docs/data-plane.md)."""
    if configured:
        return configured
    return 16384 if pool_device.startswith("cuda") else 1024


def new_base_tag(random_bits: int) -> int:
    """A transfer's base tag from 39 random bits: the piece index fills the low TAG_BITS."""
    return ((random_bits & ((1 << 39) - 1)) | 1 << 38) << TAG_BITS


Cut = Callable[[list[Run]], list[list[Run]]]  # a segment's runs -> the runs of each piece


def piece_per_run(runs: list[Run]) -> list[list[Run]]:
    """Each run of consecutive decode blocks a piece of its own: every byte lands in place."""
    return [[run] for run in runs]


def piece_per_segment(runs: list[Run]) -> list[list[Run]]:
    """The whole segment one piece, however scattered its decode blocks: one message."""
    return [runs]


class TransferPlan:
    def __init__(
        self,
        layout: KVLayout,
        prompt_len: int,
        destination: KVDestination,
        cut: Cut = piece_per_run,
    ):
        bs, skip = layout.block_size, destination.skip_tokens
        if skip < 0 or skip % bs or skip >= prompt_len:
            raise PlanError(
                f"skip_tokens {skip} must be a multiple of {bs} below the prompt length"
            )
        if destination.segment_tokens <= 0 or destination.segment_tokens % bs:
            raise PlanError(f"segment_tokens must be a positive multiple of the block size {bs}")
        if len(destination.block_ids) != -(-prompt_len // bs) - skip // bs:
            raise PlanError(
                f"{len(destination.block_ids)} destination blocks for tokens {skip}..{prompt_len}"
            )
        if destination.base_tag % MAX_PIECES or not 0 < destination.base_tag < 1 << 64:
            raise PlanError("base_tag must be a positive 64-bit tag with its low bits clear")
        self.layout = layout
        self.prompt_len = prompt_len
        self.destination = destination
        self.cut = cut
        self.block_bytes = bytes_per_token(layout) * bs  # every layer's keys and values
        self.routes = transfer_routes(layout, destination)
        self.source_heads = max(1, layout.num_kv_heads // destination.prefill_tp)  # per rank
        self.by_dest = [
            tuple(r for r in self.routes if r.dest == dest) for dest in range(destination.decode_tp)
        ]
        self.segments = self._segments()
        self.pieces = [p for seg in self.segments for p in seg.pieces]
        if len(self.pieces) > MAX_PIECES:
            raise PlanError("too many pieces for one transfer")

    @property
    def num_tokens(self) -> int:
        return self.prompt_len - self.destination.skip_tokens

    @property
    def nbytes(self) -> int:
        return sum(self.piece_bytes(p) for p in self.pieces)

    def tag(self, piece: Piece) -> int:
        return self.destination.base_tag + piece.index

    def piece_bytes(self, piece: Piece) -> int:
        heads = piece.heads[1] - piece.heads[0]
        return piece.blocks * self.block_bytes * heads // self.layout.num_kv_heads

    def _runs(self, start: int, end: int) -> list[tuple[int, int, Run]]:
        """(start, end, run) of the block-aligned token ranges of [start, end) whose decode
        blocks are consecutive."""
        bs, skip, ids = (
            self.layout.block_size,
            self.destination.skip_tokens,
            self.destination.block_ids,
        )
        runs: list[tuple[int, int, Run]] = []
        for pos in range(start, end, bs):
            block, stop = ids[(pos - skip) // bs], min(end, pos + bs)
            if runs and runs[-1][2].first + runs[-1][2].blocks == block:
                first, _, run = runs[-1]
                runs[-1] = (first, stop, Run(run.first, run.blocks + 1))
            else:
                runs.append((pos, stop, Run(block, 1)))
        return runs

    def _segments(self) -> list[Segment]:
        size, skip = self.destination.segment_tokens, self.destination.skip_tokens
        segments, index = [], 0
        start = skip
        while start < self.prompt_len:
            end = min(self.prompt_len, (start // size + 1) * size)
            spans = self._runs(start, end)
            pieces = []
            for into in self.by_dest:
                at = 0
                for runs in self.cut([run for _, _, run in spans]):
                    first, last = spans[at], spans[at + len(runs) - 1]
                    whole = len(into) == 1 and into[0].heads == self.source_heads
                    pieces.append(
                        Piece(index, len(segments), first[0], last[1], tuple(runs), into, whole)
                    )
                    index, at = index + 1, at + len(runs)
            segments.append(Segment(len(segments), start, end, tuple(pieces)))
            start = end
        return segments


def transfer_routes(layout: KVLayout, destination: KVDestination) -> list[Route]:
    """Which prefill rank sends which KV heads to which decode rank (one route of every head
    between single ranks); PlanError for degrees that do not split the layout's KV heads."""
    heads, degrees = layout.num_kv_heads, (destination.prefill_tp, destination.decode_tp)
    queries = heads * degrees[0] * degrees[1]  # not the KV's concern: any count both degrees split
    try:
        return routes(*(HeadSplit(queries, heads, tp) for tp in degrees))
    except TPError:
        raise PlanError(
            f"tensor-parallel degrees {degrees[0]} -> {degrees[1]} do not split {heads} KV heads"
        ) from None
