"""TransferPlan: how one prompt's KV is cut into UCX messages, computed alike on both ends.

Both workers derive the same plan from the PrefillTask's KVDestination, so no per-message
control traffic is needed: piece i travels with tag `base_tag + i` and has a known size.

The decode pool is [layers, 2, slots, kv_heads, head_dim]. The keys (or values) of one layer
over a run of consecutive decode blocks are one contiguous range of it, so each piece is
(segment, layer, keys|values, run) and lands in the pool directly: no copy on the decode side.
The prefill side sends a piece straight from its own pool when its slots there are consecutive
too, and gathers it once otherwise (see KVSender). Segments are fixed ranges of token positions;
a segment is sent as soon as the prefill has computed all its tokens (chunk-wise pipelining).
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
    layer: int
    kv: int  # 0 = keys, 1 = values
    start: int  # token positions [start, end) of the prompt
    end: int
    dst_slot: int  # first slot of the destination run in the decode pool

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Segment:
    index: int
    start: int
    end: int
    pieces: tuple[Piece, ...]


def segment_tokens(configured: int, pool_device: str) -> int:
    """The segment size a decode worker asks for: `configured`, or (0) its pool's default. Each
    piece costs tens of microseconds of Python and UCX however small it is: on a CPU that is
    a fraction of copying a 1024-token piece, on a GPU (measured on an H200, cuda_ipc) 30 times
    the copy, so there a piece should be as large as a prompt is long."""
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
        self.token_bytes = bytes_per_token(layout) // (
            2 * layout.num_layers
        )  # one layer, keys or values
        self.segments = self._segments()
        self.pieces = [p for seg in self.segments for p in seg.pieces]
        if len(self.pieces) > MAX_PIECES:
            raise PlanError("too many pieces for one transfer")

    @property
    def num_tokens(self) -> int:
        return self.prompt_len - self.destination.skip_tokens

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.token_bytes * 2 * self.layout.num_layers

    def tag(self, piece: Piece) -> int:
        return self.destination.base_tag + piece.index

    def piece_bytes(self, piece: Piece) -> int:
        return piece.tokens * self.token_bytes

    def _runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(start, end, first decode slot) of token ranges whose decode blocks are consecutive."""
        bs, skip, ids = (
            self.layout.block_size,
            self.destination.skip_tokens,
            self.destination.block_ids,
        )
        runs: list[tuple[int, int, int]] = []
        pos = start
        while pos < end:
            block = ids[(pos - skip) // bs]
            slot = block * bs + pos % bs
            stop = min(end, (pos // bs + 1) * bs)
            if runs and runs[-1][1] == pos and runs[-1][2] + (pos - runs[-1][0]) == slot:
                runs[-1] = (runs[-1][0], stop, runs[-1][2])
            else:
                runs.append((pos, stop, slot))
            pos = stop
        return runs

    def _segments(self) -> list[Segment]:
        size, skip = self.destination.segment_tokens, self.destination.skip_tokens
        segments, index = [], 0
        start = skip
        while start < self.prompt_len:
            end = min(self.prompt_len, (start // size + 1) * size)
            runs = self._runs(start, end)
            pieces = []
            for layer in range(self.layout.num_layers):
                for kv in (0, 1):
                    for a, b, slot in runs:
                        pieces.append(Piece(index, len(segments), layer, kv, a, b, slot))
                        index += 1
            segments.append(Segment(len(segments), start, end, tuple(pieces)))
            start = end
        return segments
