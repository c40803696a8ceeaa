"""TransferPlan: how one prompt's KV is cut into UCX messages, computed alike on both ends.

Both workers derive the same plan from the PrefillTask's KVDestination, so no per-message
control traffic is needed: piece i travels with tag `base_tag + i` and has a known size.

The pools are block-major (shared.engine.kv_cache): a run of consecutive decode blocks holds
every layer's keys and values of its positions as one contiguous range. Each piece is
(segment, run): whole blocks, every layer, landing in the decode pool directly, with no copy on
the decode side. The prefill side sends a piece straight from its own pool when its blocks
there are consecutive too, and gathers it once otherwise (see KVSender). Segments are fixed
ranges of token positions, whole blocks each; a segment is sent as soon as the prefill has
computed all its tokens (chunk-wise pipelining). The last block of a prompt travels whole:
its positions past the prompt hold whatever the prefill pool had there, which the decode
worker overwrites as it generates and never reads before.
"""

from dataclasses import dataclass

from shared.control.messages import KVDestination, KVLayout
from shared.engine.kv_cache import bytes_per_token

TAG_BITS = 24  # low bits of a tag: the piece index
MAX_PIECES = 1 << TAG_BITS


class PlanError(ValueError):
    """A destination that does not fit the prompt or the layout."""


@dataclass(frozen=True)
class Piece:
    index: int  # tag = base_tag + index
    segment: int
    start: int  # token positions [start, end) of the prompt; start is a block's first
    end: int
    dst_block: int  # the first block of the destination run in the decode pool
    blocks: int  # how many (consecutive) blocks the piece fills


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


class TransferPlan:
    def __init__(self, layout: KVLayout, prompt_len: int, destination: KVDestination):
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
        self.block_bytes = bytes_per_token(layout) * bs  # every layer's keys and values
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
        return piece.blocks * self.block_bytes

    def _runs(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """(start, end, first decode block, blocks) of the block-aligned token ranges of
        [start, end) whose decode blocks are consecutive."""
        bs, skip, ids = (
            self.layout.block_size,
            self.destination.skip_tokens,
            self.destination.block_ids,
        )
        runs: list[tuple[int, int, int, int]] = []
        for pos in range(start, end, bs):
            block, stop = ids[(pos - skip) // bs], min(end, pos + bs)
            if runs and runs[-1][2] + runs[-1][3] == block:
                first, _, dst, count = runs[-1]
                runs[-1] = (first, stop, dst, count + 1)
            else:
                runs.append((pos, stop, block, 1))
        return runs

    def _segments(self) -> list[Segment]:
        size, skip = self.destination.segment_tokens, self.destination.skip_tokens
        segments, index = [], 0
        start = skip
        while start < self.prompt_len:
            end = min(self.prompt_len, (start // size + 1) * size)
            pieces = []
            for a, b, block, count in self._runs(start, end):
                pieces.append(Piece(index, len(segments), a, b, block, count))
                index += 1
            segments.append(Segment(len(segments), start, end, tuple(pieces)))
            start = end
        return segments
