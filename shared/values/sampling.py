"""How a request samples, and what a sampled token's log-probability carries: values both the
engine and the control plane hold (a GenerateTask carries them; a Sequence samples with them).

The choices of a request that asks for n > 1: the prompt is computed once, under the group's
attempt id; at its first token the decode worker forks it into n sequences that share the prompt's
KV blocks (the group's own goes on as choice 0). From then on each choice streams under an id of
its own (`<group id>~<index>`, known from the start, so a choice is cancelled alone and its stream
is there before the fork) and samples with a seed of its own (the request's seed + its index), so a
request with n = 1 and that seed gives the same choice.

Penalties and biases (presence_penalty, frequency_penalty, repetition_penalty, the logit bias and
min_tokens) are OpenAI's and vLLM's: shared/engine/penalties.py applies them. The logit bias
travels as two lists of one length (token ids, values): the wire has no maps of int keys.
Like max_tokens, min_tokens counts this attempt's output: a moved request's is lowered by what
the client already has.
"""

import dataclasses
from dataclasses import dataclass, field

from shared.values.constraint import Constraint

SEED_SPACE = 1 << 64


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return each sampled token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives at each position
    n: int = 1  # choices: the prompt computed once, each choice sampled with seed + its index
    presence_penalty: float = 0.0  # subtracted from a token's logit once it is in the output
    frequency_penalty: float = 0.0  # subtracted per time a token is in the output
    repetition_penalty: float = 1.0  # divides (> 0) or multiplies (< 0) a seen token's logit
    bias_token_ids: list[int] = field(default_factory=list)  # the logit bias: these tokens'
    bias_values: list[float] = field(default_factory=list)  # logits get these added
    min_tokens: int = 0  # no end token (nor stop string) before this many output tokens

    def shapes_logits(self) -> bool:
        """Whether a penalty, a bias or min_tokens changes its logits before a token is drawn."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.bias_token_ids
            or self.min_tokens
        )

    # each prompt token's log-probability (and top_logprobs alternatives) from the position before
    # it, computed where the prompt is computed: OpenAI's echo with logprobs
    prompt_logprobs: bool = False
    constraint: Constraint | None = None  # structured output: what the output must match


@dataclass
class TokenLogprob:
    """A sampled token's log-probability under the model (the raw logits' log-softmax, before
    temperature or top-k/top-p), and the most likely tokens at its position."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """The log-probability of each prompt token after the first, under the raw logits of the
    position before it, and the `top` most likely tokens there: one column per field (row i is
    prompt token i + 1), so a long prompt's travel as four lists, not a map per position."""

    top: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)  # row i's are [i * top, (i + 1) * top)
    top_logprobs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def row(self, i: int) -> TokenLogprob:
        span = slice(i * self.top, (i + 1) * self.top)
        return TokenLogprob(self.logprobs[i], self.top_ids[span], self.top_logprobs[span])


def choice_id(group_id: str, index: int) -> str:
    return f"{group_id}~{index}"


def choice_sampling(params: SamplingParams, index: int) -> SamplingParams:
    """How choice `index` samples: alone (n = 1), with the request's seed + index."""
    seed = (params.seed + index) % SEED_SPACE
    return dataclasses.replace(params, n=1, seed=seed, stop=list(params.stop))
