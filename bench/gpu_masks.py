"""The GPU check's masks step: structured outputs' grammar masks applied to logits rows on the
device (shared/engine/token_mask.py's RowMasks, torch's path: the C++ kernel is the CPU's) equal
the CPU's, bit for bit, and what applying them costs a step at 32 and 128 rows of the model's
vocabulary. The bitmasks are random (a grammar's are filled on the CPU whatever the device:
their cost is bench/results/structured-outputs.md's)."""

import statistics
import time

import torch

from shared.engine import kernels as cpu_kernels
from shared.engine.token_mask import RowMasks
from shared.values.constraint import MASK_WORD as WORD

ROWS = (32, 128)


class _Bits:
    """A Masker that hands back fixed bitmasks, a row per mask."""

    def __init__(self, bits: torch.Tensor):
        self.bits = bits

    def bitmask(self, masks) -> torch.Tensor:
        return self.bits[: len(masks)]


class _Row:
    def __init__(self, masker: _Bits):
        self.masker = masker


def masks(device: str, vocab: int, report: dict) -> None:
    generator = torch.Generator().manual_seed(0)
    out = {"vocab": vocab, "rows": {}}
    for rows in ROWS:
        logits = torch.randn(rows + 8, vocab, generator=generator)
        words = (vocab + WORD - 1) // WORD
        bits = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=generator)
        masker = _Bits(bits.to(torch.int32))  # one masker: the rows' masks in one call
        masked = [(row + 8, _Row(masker)) for row in range(rows)]
        [(_, expected)] = RowMasks(cpu_kernels.load()).masked(logits, masked)
        on_device = logits.to(device)
        device_masks = RowMasks()
        [(_, got)] = device_masks.masked(on_device, masked)
        times = []
        for _ in range(20 if device.startswith("cuda") else 3):  # a dry run only proves the path
            _sync(device)
            started = time.perf_counter()
            device_masks.masked(on_device, masked)
            _sync(device)
            times.append(time.perf_counter() - started)
        out["rows"][str(rows)] = {
            "identical": bool(torch.equal(got.cpu(), expected)),
            "ms": statistics.median(times) * 1e3,
        }
        print(f"  masks {rows} rows: {out['rows'][str(rows)]}")
    report["masks"] = out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
