"""TokenMask: what the engine asks of a sequence's structured-output state (a grammar's,
shared/grammar/state.py builds one): the tokens it took, and, through its Masker, which tokens may
come next, as a bitmask computed for a step's states at once; and RowMasks, which applies those
bitmasks to copies of their logits rows.

A bitmask is int32 [rows, words]: bit k of word w set where token 32 * w + k may come next (the
form llguidance and xgrammar both fill); tokens past 32 * words never may."""

from typing import Protocol

import torch


class Masker(Protocol):
    def bitmask(self, masks: list["TokenMask"]) -> torch.Tensor:
        """int32 [len(masks), words] on the CPU: each mask's next tokens (a finished one's: the
        end tokens only). Valid until the next call."""


class TokenMask(Protocol):
    @property
    def finished(self) -> bool:
        """The output is complete (or can go no further): the sequence ends."""

    @property
    def masker(self) -> Masker:
        """Computes this state's mask together with the others it computes (the same object for
        every state of one grammar compiler)."""

    def accept(self, token: int) -> None:
        """The sequence took `token`."""

    def fork(self) -> "TokenMask":
        """The same state, for another choice of the request (n > 1)."""


class RowMasks:
    """A step's constrained rows, each a copy of its logits row with the tokens its mask
    disallows at -inf (the runner's logits are left as they are). On a CPU with Tandem's kernels
    (`kernels`, the runner's), one pass per row (csrc/token_masks.cpp); elsewhere a bitmask becomes
    an additive row of 0 and -inf through a table of each byte's 8 bits (a gather, then one add:
    a masked fill with a bool row costs several times more on a CPU)."""

    KERNEL_DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, kernels=None):
        self._kernels = kernels
        self._tables: dict[tuple, torch.Tensor] = {}

    @torch.inference_mode()
    def masked(
        self, logits: torch.Tensor, masked: list[tuple[int, TokenMask]]
    ) -> list[tuple[list[int], torch.Tensor]]:
        """The listed rows' masked copies: (rows, their copies [len(rows), vocab]) for each
        masker (one, but for masks of several compilers)."""
        by_masker: dict[Masker, list[tuple[int, TokenMask]]] = {}
        for row, mask in masked:
            by_masker.setdefault(mask.masker, []).append((row, mask))
        out = []
        for masker, group in by_masker.items():
            bits = masker.bitmask([mask for _, mask in group])
            index = torch.tensor([row for row, _ in group], device=logits.device)
            if (
                self._kernels is not None
                and logits.device.type == "cpu"
                and logits.dtype in self.KERNEL_DTYPES
            ):
                rows = self._kernels.masked_rows(logits.contiguous(), index, bits)
            else:
                rows = logits.index_select(0, index)
                self._apply(rows, bits.to(logits.device))
            out.append(([row for row, _ in group], rows))
        return out

    def _apply(self, rows: torch.Tensor, bits: torch.Tensor) -> None:
        width = rows.shape[-1]
        table = self._table(rows.dtype, rows.device)
        bias = table.index_select(0, bits.view(torch.uint8).reshape(-1).long())
        bias = bias.view(rows.shape[0], -1)
        covered = min(width, bias.shape[1])
        rows[:, :covered].add_(bias[:, :covered])
        rows[:, covered:] = float("-inf")

    def _table(self, dtype, device) -> torch.Tensor:
        """[256, 8]: byte b's bit k as 0 (set: allowed) or -inf."""
        key = (dtype, device)
        if key not in self._tables:
            bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
            table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf"))
            self._tables[key] = table.to(device)
        return self._tables[key]
