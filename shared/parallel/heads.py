"""HeadSplit: how a tensor-parallel group of `tp` ranks splits a model's attention heads, and
routes: which rank of a prefill group sends which KV heads to which rank of a decode group.

Megatron-style: rank r holds query heads [r*q, (r+1)*q), q = heads / tp, and the KV heads those
query heads read. When the KV heads divide among the ranks each holds kv_heads / tp of them; when
there are fewer KV heads than ranks (GQA), each KV head is held by tp / kv_heads ranks (replicated,
as the peers do), rank r holding head r // (tp / kv_heads). Any other degree is refused, naming the
degrees that would work. A rank's KV pool holds only its heads; the group's block table is one.

Between groups of different degrees every decode rank receives each KV head it holds exactly once,
from a prefill rank that holds it (where several do, the decode ranks take turns among them), in
runs of consecutive heads: prefill TP=2 -> decode TP=1 is two senders into one pool, TP=1 -> TP=2
one sender split between two receivers. Both ends derive the same routes from the two splits.
"""

from dataclasses import dataclass


class TPError(ValueError):
    """A tensor-parallel degree a model's heads cannot be split by."""


def fits(num_heads: int, num_kv_heads: int, tp: int) -> bool:
    if tp < 1 or num_heads % tp or num_heads % num_kv_heads:
        return False
    return num_kv_heads % tp == 0 or tp % num_kv_heads == 0


def valid_degrees(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every degree that splits these heads, smallest first (1 always)."""
    return [tp for tp in range(1, num_heads + 1) if fits(num_heads, num_kv_heads, tp)]


@dataclass(frozen=True)
class HeadSplit:
    num_heads: int  # query heads
    num_kv_heads: int
    tp: int

    def __post_init__(self):
        if not fits(self.num_heads, self.num_kv_heads, self.tp):
            degrees = ", ".join(map(str, valid_degrees(self.num_heads, self.num_kv_heads)))
            raise TPError(
                f"a tensor-parallel degree of {self.tp} does not split {self.num_heads} query "
                f"heads and {self.num_kv_heads} KV heads; degrees that would: {degrees}"
            )

    @property
    def replicas(self) -> int:
        """How many ranks hold each KV head (1 unless there are fewer KV heads than ranks)."""
        return max(1, self.tp // self.num_kv_heads)

    @property
    def kv_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    def q_heads(self, rank: int) -> tuple[int, int]:
        """The query heads [first, end) rank holds."""
        q = self.num_heads // self.tp
        return rank * q, (rank + 1) * q

    def kv_heads(self, rank: int) -> tuple[int, int]:
        """The KV heads [first, end) rank holds (in its own pool, from index 0)."""
        first = (rank // self.replicas) * self.kv_per_rank
        return first, first + self.kv_per_rank

    def holders(self, head: int) -> list[int]:
        """The ranks that hold KV head `head`."""
        return [r for r in range(self.tp) if self.kv_heads(r)[0] <= head < self.kv_heads(r)[1]]


@dataclass(frozen=True)
class Route:
    """KV heads [first, end) (the model's numbering) from prefill rank `source` to decode rank
    `dest`: at `source_offset` of the sender's heads, at `dest_offset` of the receiver's."""

    source: int
    dest: int
    first: int
    end: int
    source_offset: int
    dest_offset: int

    @property
    def heads(self) -> int:
        return self.end - self.first


def routes(prefill: HeadSplit, decode: HeadSplit) -> list[Route]:
    """Every (prefill rank -> decode rank, head run) of a transfer between the two groups, by
    decode rank then head."""
    if (prefill.num_heads, prefill.num_kv_heads) != (decode.num_heads, decode.num_kv_heads):
        raise TPError("a prefill and a decode group of different models never pair")
    out: list[Route] = []
    for dest in range(decode.tp):
        first, end = decode.kv_heads(dest)
        for head in range(first, end):
            holders = prefill.holders(head)
            source = holders[dest % len(holders)]  # replicated: decode ranks take turns
            last = out[-1] if out and out[-1].dest == dest else None
            if last is not None and last.source == source and last.end == head:
                out[-1] = Route(
                    source, dest, last.first, head + 1, last.source_offset, last.dest_offset
                )
                continue
            offset = head - prefill.kv_heads(source)[0]
            out.append(Route(source, dest, head, head + 1, offset, head - first))
    return out
