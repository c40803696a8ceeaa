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
as each token is appended (a dict look-up and a scalar write). A step costs a few vectorised ops
over the tokens the sequence has seen, in place on its row, and as many to put them back once its
token is drawn (returned logprobs are the model's own, and a runner may keep its buffer: a copy
of the row would cost more than the rest, ~50 us at 49k tokens); never a loop over its output. Nothing of it travels: the prefill
worker that draws a first token and the decode worker that draws the rest (or the one a request
moved to) each build it from the same tokens, the prompt and what the sequence was handed.
"""

import copy
import functools
import math
from collections import Counter
from collections.abc import Callable

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

    @torch.inference_mode()  # a forward pass's logits are inference tensors
    def apply(
        self, logits: torch.Tensor, prompt: list[int], resumed: int, output: list[int]
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """The next token's logits [vocab], shaped in place (a float32 copy of others), and what
        puts them back as they were (logprobs read the raw row, and a runner may keep its
        buffer). `prompt` (its last `resumed` tokens output the client had) and `output` are the
        sequence's tokens: read the first time only."""
        if not self._built:
            self._build(logits, prompt, resumed, output)
        row, masking = logits.float(), len(output) < self.min_tokens
        touched = self._touched(masking)
        saved = row.index_select(0, touched) if row is logits else None
        if masking and self._end_ids is not None:
            row.index_fill_(0, self._end_ids, -math.inf)
        if self._bias_ids is not None:
            row.index_add_(0, self._bias_ids, self._bias_values)
        if self._seen is not None:
            ids, r = self._seen.ids, self.repetition
            seen = row.index_select(0, ids)
            row.index_copy_(0, ids, torch.where(seen > 0, seen / r, seen * r))
        if self._counted is not None:
            row.index_add_(0, self._counted.ids, self._counted.values)
        return row, functools.partial(_put_back, row, touched, saved)

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

    def _touched(self, masking: bool) -> torch.Tensor:
        """The ids this step's shaping writes (some twice, perhaps)."""
        tables = (self._seen, self._counted)
        parts = [t.ids for t in tables if t is not None] + [self._bias_ids]
        parts.append(self._end_ids if masking else None)
        return torch.cat([p for p in parts if p is not None] or [self._none])

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


@torch.inference_mode()
def _put_back(row: torch.Tensor, ids: torch.Tensor, saved: torch.Tensor | None) -> None:
    """The row as it was before it was shaped (a copy was shaped: nothing to do)."""
    if saved is not None:
        row.index_copy_(0, ids, saved)  # an id twice: the same value twice
