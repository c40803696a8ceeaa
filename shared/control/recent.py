"""RecentIds: ids seen lately, forgotten after a while, bounded in size."""

import time
from collections import OrderedDict
from collections.abc import Callable


class RecentIds:
    def __init__(
        self, ttl_s: float, max_size: int = 10_000, clock: Callable[[], float] = time.monotonic
    ):
        self._ttl = ttl_s
        self._max = max_size
        self._clock = clock
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, item: str) -> None:
        self._ids[item] = self._clock()
        self._ids.move_to_end(item)
        self._prune()

    def __contains__(self, item: str) -> bool:
        self._prune()
        return item in self._ids

    def _prune(self) -> None:
        horizon = self._clock() - self._ttl
        while self._ids and (
            len(self._ids) > self._max or next(iter(self._ids.values())) < horizon
        ):
            self._ids.popitem(last=False)
