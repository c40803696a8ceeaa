"""FilePages: giving back the resident pages of weights read from memory-mapped files.

Hugging Face maps safetensors files into memory and hands out tensors that point into the
mapping. Once the engine has packed a layer's weights into its own layout, the originals are
never read again, but their pages, touched by the packing, stay resident (and counted in the
process's RSS) for as long as any tensor of that file lives: the tied embedding keeps a file
mapped for the whole run. `drop` tells the kernel those pages are no longer needed
(madvise MADV_DONTNEED on a private file mapping: the page cache keeps the data; a later read,
which the engine never makes, would fault the file's bytes in again). Only pages wholly inside a
released tensor that lies in a file mapping are dropped: anonymous memory, which MADV_DONTNEED
would zero, is never touched.
"""

import ctypes
import logging
import mmap
import os

log = logging.getLogger(__name__)
MADV_DONTNEED = 4


def file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's private mappings of files."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) < 6 or not fields[5].startswith("/") or fields[1][3] != "p":
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    except OSError:
        pass
    return ranges


class FilePages:
    def __init__(self):
        self.mappings = file_mappings()
        self.page = mmap.PAGESIZE
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise if os.name == "posix" else None
        self.dropped = 0  # bytes

    def drop(self, tensor) -> None:
        """Drops the resident pages of `tensor` if it lies in a private file mapping: a tensor
        never read again, or one read sparsely afterwards (an embedding table), never written."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if self._madvise is None or not any(a <= start and end <= b for a, b in self.mappings):
            return
        first = -(-start // self.page) * self.page
        last = end // self.page * self.page
        if last <= first:
            return
        if self._madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED):
            log.debug("madvise failed: %s", os.strerror(ctypes.get_errno()))
            return
        self.dropped += last - first
