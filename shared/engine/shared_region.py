"""SharedRegion: memory a worker and its data-plane helper process both map (an anonymous memfd,
handed to the helper by file descriptor), and where in it a buffer lies.

The KV pool of a worker whose data plane runs in a helper process (shared.dataplane.helper_plane)
lives in one: UCX in the helper reads and writes the pool's bytes in place, so moving the data
plane out of the worker's process costs no copy. Nothing is named in /dev/shm, so nothing is left
behind when a process dies.
"""

import mmap
import os

import numpy


class SharedRegion:
    """`nbytes` of zeroed memory shared by file descriptor; `array` is a uint8 view of all of it."""

    def __init__(self, nbytes: int, fd: int | None = None):
        if nbytes <= 0:
            raise ValueError("a shared region needs a positive size")
        self.nbytes = nbytes
        if fd is None:
            fd = os.memfd_create("tandem-kv", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        self.fd = fd
        # Populated at once: a page first touched by UCX's copy would fault there, once per 4 KiB
        # page and per process (that halved the helper's throughput on 128 MB transfers).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = numpy.frombuffer(self._map, dtype=numpy.uint8)
        self.base = self.array.ctypes.data

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> "SharedRegion":
        """The helper's side: maps a region another process made."""
        return cls(nbytes, fd)

    def tensor(self):
        """A torch uint8 tensor over the whole region (the worker's side)."""
        import torch

        return torch.frombuffer(self._map, dtype=torch.uint8)

    def offset_of(self, address: int, nbytes: int) -> int | None:
        """Where [address, address + nbytes) starts in this region, or None if not inside it."""
        offset = address - self.base
        if offset >= 0 and offset + nbytes <= self.nbytes:
            return offset
        return None

    def view(self, offset: int, nbytes: int) -> numpy.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"[{offset}, {offset + nbytes}) is outside a {self.nbytes}-byte region"
            )
        return self.array[offset : offset + nbytes]


def locate(regions: list[SharedRegion], address: int, nbytes: int) -> tuple[int, int]:
    """(region index, offset) of a buffer; ValueError if no region holds all of it."""
    for index, region in enumerate(regions):
        offset = region.offset_of(address, nbytes)
        if offset is not None:
            return index, offset
    raise ValueError("a KV buffer outside every region shared with the data-plane helper")
