"""AbandonedSends: the buffers of KV sends that failed, kept while UCX may still read them.

ucxx cannot cancel one posted request: a send that timed out may still be read by its receiver,
so its buffers (a gathered copy, or a view that keeps the pool alive anyway) must outlive it. They
are kept until every request of the send completed, or for `ttl_s` (the receiver's lease is long
over by then), and never more than `max_sends` sends: the oldest go first.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class _Send:
    requests: list
    buffers: list[torch.Tensor]
    since: float

    def over(self, now: float, ttl_s: float) -> bool:
        """Nothing can read the buffers any more: every request ended, or the TTL passed."""
        return now - self.since > ttl_s or all(r.completed for r in self.requests)


class AbandonedSends:
    def __init__(self, max_sends: int = 256, ttl_s: float = 600.0):
        self._ttl_s = ttl_s
        self._sends: deque[_Send] = deque(maxlen=max_sends)

    def keep(self, requests: list, buffers: list[torch.Tensor]) -> None:
        now = time.monotonic()
        live = [s for s in self._sends if not s.over(now, self._ttl_s)]
        self._sends = deque(live, maxlen=self._sends.maxlen)
        self._sends.append(_Send(requests, buffers, now))

    def __len__(self) -> int:
        return len(self._sends)
