"""FilePages: giving back the resident pages of weights read from memory-mapped files.

Hugging Face maps safetensors files into memory and hands out tensors that point into the
mapping. Once the engine has packed a layer's weights into its own layout, the originals are
never read again, but their pages, touched by the packing, stay resident (and counted in the
process's RSS) for as long as any tensor of that file lives: the tied embedding keeps a file
mapped for the whole run. `drop` tells the kernel those pages are no longer needed
(madvise MADV_DONTNEED on a private mapping of a safetensors file none of whose pages was ever
written: the page cache keeps the data, and a later read faults the file's own bytes back in).
Only pages wholly inside such a tensor are dropped; anonymous memory, which MADV_DONTNEED would
zero, and written pages, which it would revert, are never touched.
"""

import ctypes
import logging
import mmap
import os
from contextlib import contextmanager

log = logging.getLogger(__name__)
MADV_DONTNEED = 4


def file_mappings(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """[start, end) of this process's private mappings of `suffix` files of which no page was
    ever written (Private_Dirty 0: dropping a page gives back exactly the file's bytes)."""
    ranges, current = [], None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                fields = line.split()
                if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                    path = fields[5] if len(fields) >= 6 else ""
                    private = fields[1][3] == "p" and path.endswith(suffix)
                    current = tuple(int(x, 16) for x in fields[0].split("-")) if private else None
                elif current is not None and fields[0] == "Private_Dirty:":
                    if int(fields[1]) == 0:
                        ranges.append(current)
                    current = None
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
        """Drops the resident pages of `tensor` if it lies in a clean safetensors mapping: a
        tensor never read again, or one read sparsely afterwards (an embedding table)."""
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


def convertible(model) -> bool:
    """Whether `convert` gives what `from_pretrained(dtype=...)` would: every floating buffer is
    one it knows how to build (the rotary frequencies, float32 in any dtype, and Gemma's
    embedding scale, built in the model's dtype). A model with any other: load it converting."""
    return all(
        name.split(".")[-1] in KNOWN_BUFFERS
        for name, buffer in model.named_buffers()
        if buffer.is_floating_point()
    )


def convert(model, dtype, keep=None) -> None:
    """Converts a model loaded in its checkpoint's dtype (its weights still in the mapped files)
    to `dtype` one parameter at a time, giving back each original's pages as it goes: memory
    peaks near the converted weights alone, where Hugging Face's converting loader holds both.

    For a `convertible` model the result is what `from_pretrained(dtype=dtype)` gives: the same
    conversion of every weight, and the buffers a model built in `dtype` has. `keep` (a tied
    embedding table whose output head is already packed) stays as it is, to be read row by row;
    parameters already in `dtype`, or emptied once packed, are left alone.
    """
    import torch

    pages = FilePages()
    with torch.no_grad():
        for param in model.parameters():  # a tied weight is one parameter: converted once
            if param is keep or param.dtype == dtype or param.numel() == 0:
                continue
            converted = param.data.to(dtype)
            pages.drop(param.data)
            param.data = converted
        for module in model.modules():
            if isinstance(getattr(module, "embed_scale", None), torch.Tensor):
                module.embed_scale = torch.tensor(model.config.hidden_size**0.5, dtype=dtype)
    model.config.dtype = dtype


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
KNOWN_BUFFERS = ("inv_freq", "original_inv_freq", "embed_scale")


@contextmanager
def allocations_given_back(after: int = 32 << 20):
    """While loading: every allocation of 128 KiB or more is its own mapping, unmapped when freed,
    so the weights freed as they are converted or packed leave the process at once (glibc
    otherwise raises its threshold after the first large free and keeps later ones in its heap).
    Afterwards the threshold stays at `after` (where glibc's own adjustment tops out)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if os.name == "posix" else None
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 128 << 10)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, after)
