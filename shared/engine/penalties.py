"""Penalties and biases: what a sequence's request and its own tokens do to its logits before a
token is drawn. The definitions are OpenAI's and vLLM's, applied in vLLM v1's order:

1. min_tokens: the end tokens (the ids the worker stops on; none with ignore_eos) get -inf while
   the sequence has fewer output tokens than that;
2. the logit bias: each listed token's logit gets its value added;
3. repetition_penalty r (an extension, as in vLLM and Hugging Face): the logit of every token
   that occurs in the prompt or the output is divided by r where it is positive, multiplied by r
   where it is not;
4. frequency_penalty f and presence_penalty p (OpenAI's): a token's logit loses f for each time
   it occurs in the output, and p once if it occurs there at all.

The output is what the client has: a moved request's prompt ends with `resumed` tokens it was
already sent, and they count as output (for repetition they are in the prompt anyway).

A sequence's row is shaped from its own state only: batch-invariant by construction. The state is
built from the tokens the first time a token is drawn (the prompt read once), then kept up to date
as each token is appended (a dict look-up and a scalar write). A step shapes the rows of every
sequence that asks in place, each stage one op over all of them (per-row ops cost more in
dispatch than in work), and puts them back once the tokens are drawn (returned logprobs are the
model's own, and a runner may keep its buffer: a copy of each row would cost more than the rest,
~50 us at 49k tokens); never a loop over a sequence's output. Nothing of it travels: the prefill
worker that draws a first token and the decode worker that draws the rest (or the one a request
moved to) each build it from the same tokens, the prompt and what the sequence was handed.
"""

import copy
import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.values.sampling import SamplingParams


class _Tokens:
    """Distinct token ids, each with a value, in tensors on the logits' device that grow in place
    (their capacity doubles): adding one is a scalar write, reading them a view."""

    def __init__(self, values: dict[int, float], device: torch.device):
        self.index = {token: i for i, token in enumerate(values)}
        size = max(16, 2 * len(values))
        self._ids = torch.zeros(size, dtype=torch.long, device=device)
        self._values = torch.zeros(size, dtype=torch.float32, device=device)
        if values:
            self._ids[: len(values)] = torch.tensor(list(values), dtype=torch.long)
            self._values[: len(values)] = torch.tensor(list(values.values()))

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[: len(self.index)]

    @property
    def values(self) -> torch.Tensor:
        return self._values[: len(self.index)]

    def put(self, token: int, value: float = 0.0) -> None:
        at = self.index.get(token)
        if at is None:
            at = self.index[token] = len(self.index)
            if at == self._ids.numel():
                self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
                self._values = torch.cat([self._values, torch.zeros_like(self._values)])
            self._ids[at] = token
        self._values[at] = value

    def copy(self) -> "_Tokens":
        twin = copy.copy(self)
        twin.index, twin._ids, twin._values = (
            dict(self.index),
            self._ids.clone(),
            self._values.clone(),
        )
        return twin


class Penalties:
    """One sequence's penalties, bias and min_tokens (`of`: None when its request asks for none
    of them, and it pays nothing)."""

    def __init__(self, params: SamplingParams, end_ids: set[int]):
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.repetition, self.min_tokens = params.repetition_penalty, params.min_tokens
        self._bias = dict(zip(params.bias_token_ids, params.bias_values))
        self._ends = [] if params.ignore_eos else sorted(end_ids)
        self._built, self._width, self._none = False, 0, None
        self._end_ids = self._bias_ids = self._bias_values = None
        self._seen: _Tokens | None = None  # prompt and output: repetition
        self._counted: _Tokens | None = None  # output, each with -(f x count + p)
        self._counts: dict[int, int] = {}

    @classmethod
    def of(cls, params: SamplingParams, end_ids: set[int]) -> "Penalties | None":
        return cls(params, end_ids) if params.shapes_logits() else None

    def stages(self, row: torch.Tensor, prompt: list[int], resumed: int, output: list[int]):
        """This step's shaping of the sequence's logits `row` [vocab], stage by stage (`shape`
        applies them). `prompt` (its last `resumed` tokens output the client had) and `output`
        are the sequence's tokens: read the first time only, to build the state."""
        if not self._built:
            self._build(row, prompt, resumed, output)
        seen, counted = self._seen, self._counted
        return _Stages(
            self._end_ids if len(output) < self.min_tokens else None,
            (self._bias_ids, self._bias_values),
            (seen.ids if seen is not None else None, self.repetition),
            (counted.ids, counted.values) if counted is not None else (None, None),
        )

    @torch.inference_mode()
    def add(self, token: int) -> None:
        """`token` was appended to the output (before the state is built: nothing to do, the
        build reads the output)."""
        if not self._built or not 0 <= token < self._width:
            return
        if self._seen is not None and token not in self._seen.index:
            self._seen.put(token)
        if self._counted is not None:
            count = self._counts[token] = self._counts.get(token, 0) + 1
            self._counted.put(token, self._shift(count))

    @torch.inference_mode()
    def copy(self) -> "Penalties":
        """A twin in the same state: another choice of the request goes on from here."""
        twin = copy.copy(self)
        twin._seen = self._seen.copy() if self._seen is not None else None
        twin._counted = self._counted.copy() if self._counted is not None else None
        twin._counts = dict(self._counts)
        return twin

    def _shift(self, count: int) -> float:
        return -(self.frequency * count + self.presence)

    def _build(self, logits, prompt: list[int], resumed: int, output: list[int]) -> None:
        width, device = logits.shape[-1], logits.device
        self._width, self._none = width, torch.zeros(0, dtype=torch.long, device=device)

        def within(tokens) -> list[int]:  # a model's rows may be narrower than the tokenizer's
            return [t for t in tokens if 0 <= t < width]

        if self.min_tokens and within(self._ends):
            self._end_ids = torch.tensor(within(self._ends), dtype=torch.long, device=device)
        bias = {t: v for t, v in self._bias.items() if 0 <= t < width}
        if bias:
            self._bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)
            self._bias_values = torch.tensor(list(bias.values()), device=device)
        if self.repetition != 1.0:
            self._seen = _Tokens(dict.fromkeys(within([*prompt, *output]), 0.0), device)
        if self.frequency or self.presence:
            self._counts = dict(Counter(within([*prompt[len(prompt) - resumed :], *output])))
            shifts = {t: self._shift(c) for t, c in self._counts.items()}
            self._counted = _Tokens(shifts, device)
        self._built = True


@dataclass
class _Stages:
    """One sequence's shaping in one step: ids (and values) per stage, None where it skips one."""

    ends: torch.Tensor | None  # masked with -inf
    bias: tuple  # (ids, values): added
    repetition: tuple  # (ids, r): divided by r where positive, multiplied where not
    counted: tuple  # (ids, -(f x count + p)): added


@dataclass
class _Positions:
    """Where one stage writes in a batch's flattened logits, and a value for each position."""

    at: torch.Tensor
    values: torch.Tensor | None


def _positions(entries: list[tuple], width: int, device: torch.device) -> _Positions | None:
    """One stage's (row, ids, values) of each sequence as one set of positions; values: a tensor
    (one per id), a number (for every id of the row) or None."""
    entries = [e for e in entries if e[1] is not None and len(e[1])]
    if not entries:
        return None
    sizes = [len(ids) for _, ids, _ in entries]
    spread = functools.partial(_spread, sizes=sizes, device=device)
    at = torch.cat([ids for _, ids, _ in entries]) + spread([e[0] * width for e in entries])
    values = [v for *_, v in entries]
    if values[0] is None:
        return _Positions(at, None)
    if isinstance(values[0], float):
        return _Positions(at, spread(values))
    return _Positions(at, torch.cat(values))


def _spread(each: list, sizes: list[int], device: torch.device):
    """each[i] repeated sizes[i] times, as one tensor (a number, where there is one)."""
    if len(each) == 1:
        return each[0]
    return torch.repeat_interleave(
        torch.tensor(each, device=device),
        torch.tensor(sizes, device=device),
        output_size=sum(sizes),
    )


@torch.inference_mode()  # a forward pass's logits are inference tensors
def shape(logits: torch.Tensor, staged: list[tuple[int, _Stages]]) -> Callable[[], None]:
    """Shapes rows of `logits` [rows, vocab] (float32, contiguous: the runner's) in place, each row
    by its own stages, and returns what puts them back as they were (logprobs read the raw rows,
    and a runner may keep its buffer). Each stage is one op over every row it touches, on unique
    positions: a position's new value depends on its own value and its own sequence's state
    only, so a row comes out bit for bit as it would alone (batch-invariant), in vLLM's order."""
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise TypeError(f"logits to shape must be float32 and contiguous, not {logits.dtype}")
    flat, width, device = logits.view(-1), logits.shape[-1], logits.device
    ends, bias, seen, counted = (
        _positions([(row, *stage(s)) for row, s in staged], width, device)
        for stage in (lambda s: (s.ends, None), _bias, _repetition, _counted)
    )
    touched = [p.at for p in (ends, bias, seen, counted) if p is not None]
    if not touched:
        return _nothing
    at = torch.cat(touched) if len(touched) > 1 else touched[0]
    saved = flat.index_select(0, at)
    if ends is not None:
        flat.index_fill_(0, ends.at, -math.inf)
    if bias is not None:
        flat.index_add_(0, bias.at, bias.values)
    if seen is not None:
        scores, r = flat.index_select(0, seen.at), seen.values
        flat.index_copy_(0, seen.at, torch.where(scores > 0, scores / r, scores * r))
    if counted is not None:
        flat.index_add_(0, counted.at, counted.values)
    return functools.partial(_put_back, flat, at, saved)


def _bias(s: _Stages) -> tuple:
    return s.bias


def _repetition(s: _Stages) -> tuple:
    return s.repetition


def _counted(s: _Stages) -> tuple:
    return s.counted


@torch.inference_mode()
def _put_back(flat: torch.Tensor, at: torch.Tensor, saved: torch.Tensor) -> None:
    flat.index_copy_(0, at, saved)  # a position twice: the same value twice


def _nothing() -> None:
    pass
