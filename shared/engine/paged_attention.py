"""PagedAttention: the decode rows' attention in one call, reading keys and values in place.

A small C++ kernel (csrc/paged_attention.cpp), compiled on first use for this CPU and cached
(torch's extension cache, `TORCH_EXTENSIONS_DIR`). It replaces, for the rows that decode one
token, a per-sequence scaled_dot_product_attention call per layer and the gather of scattered
blocks before it. Each (row, kv head) is computed by one thread in a fixed order, so a row's
result does not depend on the rest of the batch.

Where the kernel cannot be built (no C++ compiler) or does not apply (CUDA), `load()` returns
None and the model runner keeps the per-sequence path, with a warning.
"""

import hashlib
import logging
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_loaded: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _module_name() -> str:
    """Unique per source and CPU: the kernel is built with -march=native."""
    digest = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode() + torch.__version__.encode())
    return "tandem_paged_attention_" + digest.hexdigest()[:16]


def load():
    """The compiled kernel module, or None when it cannot be built here."""
    name = _module_name()
    if name not in _loaded:
        from torch.utils import cpp_extension

        try:
            _loaded[name] = cpp_extension.load(name=name, sources=[str(SOURCE)],
                                               extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                               extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as error:  # no compiler, no ninja, a broken toolchain: keep the slow path
            log.warning("decode attention kernel unavailable (%s); using per-sequence attention", error)
            _loaded[name] = None
    return _loaded[name]


class PagedAttention:
    """Decode attention for a batch of single-token rows, over one layer of the pool at a time."""

    def __init__(self, kernel, block_size: int, scale: float):
        self.kernel = kernel
        self.block_size = block_size
        self.scale = scale

    def plan(self, tables: list[list[int]], lengths: list[int], rows: list[int]):
        """Tensors for one forward pass: block tables (padded), context lengths, output rows."""
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        return padded, torch.tensor(lengths, dtype=torch.long), torch.tensor(rows, dtype=torch.long)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan, out: torch.Tensor) -> None:
        """q, out [rows, heads, dim]; keys, values [slots, kv_heads, dim]; writes out[plan rows]."""
        tables, lengths, rows = plan
        self.kernel.decode_attention(q, keys, values, tables, lengths, rows, out, self.block_size, self.scale)


if __name__ == "__main__":  # make kernels: build (or find) the kernel, fail loudly if it cannot be built
    logging.basicConfig(level=logging.INFO)
    if load() is None:
        raise SystemExit("the decode attention kernel could not be built (is a C++ compiler installed?)")
    print("decode attention kernel ready:", _module_name())
