"""What a benchmark sends, and when: request specs and arrival times.

Each random choice has its own generator derived from the seed (lengths, words, arrivals), so
changing, say, the rate does not change the prompts.
"""

import itertools
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from shared.benchmark.lengths import FromFile, Lengths, Uniform, draw_pair
from shared.benchmark.prompts import PromptBuilder

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: raw-text prompt of `prompt_len` tokens, exactly `output_len` tokens back."""

    index: int
    request_id: str
    prompt: str
    prompt_len: int
    output_len: int
    priority: int = 0
    tag: str = ""  # the workload it belongs to, for per-class summaries
    prefix: int | None = None  # which shared prefix the prompt starts with


@dataclass
class Workload:
    prompt_lengths: Lengths
    output_lengths: Lengths
    shared_prefix_tokens: int = 0  # each prompt starts with one of num_prefixes prefixes this long
    num_prefixes: int = 1
    priority: int = 0
    tag: str = ""
    seed: int = 0

    def __post_init__(self):
        if self.shared_prefix_tokens < 0 or self.num_prefixes < 1:
            raise ValueError("shared_prefix_tokens must be >= 0 and num_prefixes >= 1")
        shortest = shortest_length(self.prompt_lengths)
        if self.shared_prefix_tokens and shortest <= self.shared_prefix_tokens:
            raise ValueError(
                f"prompts of {shortest} tokens cannot hold a shared prefix of "
                f"{self.shared_prefix_tokens} tokens and text of their own"
            )

    def rng(self, purpose: str) -> random.Random:
        return random.Random(f"{self.seed}:{self.tag}:{purpose}")


def shortest_length(lengths: Lengths) -> int:
    if isinstance(lengths, Uniform):
        return lengths.low
    if isinstance(lengths, FromFile):
        return min(lengths.value(row) for row in range(len(lengths.rows)))
    return lengths.value


def request_specs(
    workload: Workload, tokenizer, count: int | None = None, builder: PromptBuilder | None = None
) -> Iterator[RequestSpec]:
    """`count` request specs (endless when None), built lazily: a prompt is made when it is asked for."""
    builder = builder or PromptBuilder(tokenizer, workload.rng("words"))
    prefixes = (
        builder.prefixes(workload.shared_prefix_tokens, workload.num_prefixes)
        if workload.shared_prefix_tokens
        else []
    )
    lengths_rng, prefix_rng = workload.rng("lengths"), workload.rng("prefixes")
    id_stem = _ID_UNSAFE.sub("-", f"bench-{workload.tag}" if workload.tag else "bench")[:100]
    for index in itertools.count() if count is None else range(count):
        prompt_len, output_len = draw_pair(
            workload.prompt_lengths, workload.output_lengths, lengths_rng
        )
        which = prefix_rng.randrange(len(prefixes)) if prefixes else None
        prompt = builder.build(prompt_len, prefixes[which] if prefixes else "")
        yield RequestSpec(
            index,
            f"{id_stem}-{index}",
            prompt,
            prompt_len,
            output_len,
            workload.priority,
            workload.tag,
            which,
        )


def poisson_arrivals(rate: float, seed: int | str = 0) -> Iterator[float]:
    """Send times in seconds from the start: the first at 0, then exponential gaps of mean 1/rate
    (a Poisson process). An infinite rate sends everything at 0."""
    if not rate > 0:
        raise ValueError(f"the rate must be > 0 requests/s (or inf), got {rate}")
    if math.isinf(rate):
        return itertools.repeat(0.0)
    return _poisson(rate, random.Random(f"{seed}:arrivals"))


def _poisson(rate: float, rng: random.Random) -> Iterator[float]:
    at = 0.0
    while True:
        yield at
        at += rng.expovariate(rate)
