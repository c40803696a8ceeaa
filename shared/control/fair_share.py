"""Max-min fair shares: how much of a capacity one more client may hold, given what the others hold.

Water-filling: every client gets the same level, except those that hold less than it, whose unused
part is shared among the rest. A lone client's share is the whole capacity; two busy clients get
half each; a client that holds 1 of a capacity of 100 beside a busy one leaves it 99.

Shares are over what clients hold *now*, not over a reservation: a client above its share (it came
first, when it was alone) keeps what it holds and gets no more until it is back under it, while a
newcomer is let in up to its own share. So a gateway may hold more than the capacity for a while
(at most what the clients held before the newcomers came, plus the newcomers' shares): a hard cap
elsewhere (the gateway's stream limit) bounds that.
"""

from collections.abc import Iterable


def level(capacity: int, others: Iterable[int]) -> float:
    """The share of `capacity` one more client with unbounded demand gets beside clients holding
    `others` (each > 0): the level L where sum(min(o, L) for o in others) + L == capacity."""
    held = sorted(o for o in others if o > 0)
    remaining, claimants = float(capacity), len(held) + 1
    for i, h in enumerate(held):
        share = remaining / (claimants - i)
        if h >= share:  # this client and every larger one are held down to the level
            return share
        remaining -= h
    return remaining


def within_share(mine: int, capacity: int, others: Iterable[int]) -> bool:
    """Whether a client holding `mine` may take one more: mine + 1 <= its level (at least one:
    a client holding nothing is never refused by its share)."""
    return mine == 0 or mine + 1 <= level(capacity, others)
