"""StagingBuffers: host buffers reused for the copies a KV transfer makes on the way (a piece
gathered from scattered runs or from a slice of heads before it is sent; one landed whole and
then scattered into its spans).

A fresh buffer costs a page fault per 4 KiB page the first time it is written: on a 12 MiB piece
that is several times the copy itself (measured: a strided gather of 12 MiB into a reused buffer
1.6 ms, into a fresh one 3.6 to 25 ms). So buffers are kept once used and handed out again, the
smallest one large enough first; at most `keep_bytes` of them wait idle (the rest are dropped).
A buffer a transport may still read or write (a send that timed out, a receive never ended) is
never given back: it is left to the garbage collector once nothing holds it.
"""

import bisect
import threading

import numpy

KEEP_BYTES = 256 << 20


class StagingBuffers:
    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self._idle: list[tuple[int, int, numpy.ndarray]] = []  # (size, id, buffer), by size
        self._idle_bytes = 0
        self._bases: dict[int, numpy.ndarray] = {}  # id(view handed out) -> its whole buffer
        self._lock = threading.Lock()  # taken from a copying thread, given back on the loop

    def take(self, nbytes: int) -> numpy.ndarray:
        """A uint8 buffer of `nbytes` (contents undefined), reused where one is idle."""
        with self._lock:
            at = bisect.bisect_left(self._idle, (nbytes, -1))
            base = None
            if at < len(self._idle):
                size, _, base = self._idle.pop(at)
                self._idle_bytes -= size
        if base is None:
            base = numpy.empty(max(nbytes, 1), dtype=numpy.uint8)
        view = base[:nbytes]
        with self._lock:
            self._bases[id(view)] = base
        return view

    def give(self, view: numpy.ndarray) -> None:
        """`view` (from take) is no longer read or written by anyone: it may be handed out again."""
        with self._lock:
            base = self._bases.pop(id(view), None)
            if base is None or self._idle_bytes + base.nbytes > self.keep_bytes:
                return
            bisect.insort(self._idle, (base.nbytes, id(base), base))
            self._idle_bytes += base.nbytes

    def drop(self, view: numpy.ndarray) -> None:
        """`view` may still be used by a transport: forgotten here, never handed out again."""
        with self._lock:
            self._bases.pop(id(view), None)


def landing(buffers: StagingBuffers, spans: list) -> tuple:
    """Where a message scattered over `spans` lands first, and the reused host buffer that is
    (None for a buffer on the spans' device, made for this message)."""
    first = spans[0]
    size = sum(span.nbytes for span in spans)
    if isinstance(first, numpy.ndarray):
        staged = buffers.take(size)
        return staged, staged
    import torch  # a torch tensor: torch is loaded (the helper process never comes here)

    if first.device.type == "cpu":
        staged = buffers.take(size)
        return torch.from_numpy(staged), staged
    return torch.empty(size, dtype=torch.uint8, device=first.device), None
