"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded; and what the
model thought of it (its logprob and the most likely alternatives), from the same logits.

The random draw for output position i uses a generator seeded from (seed, i) alone, so a
seeded request gives the same tokens whether its first token was sampled on a prefill worker
and the rest on a decode worker, or all of them in one colocated worker.
"""

import torch

from shared.values.sampling import SamplingParams, TokenLogprob

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1
MIN_TEMPERATURE = 1e-5
LOWEST_LOGPROB = -9999.0  # what a probability of 0 (log: -inf) is reported as, as vLLM does


def step_seed(seed: int, position: int) -> int:
    return (seed * _GOLDEN + position * 0xBF58476D1CE4E5B9 + 1) & _MASK63


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at output `position` (0 = first) from the last-position logits [vocab]."""
    # below it, exp() overflows: greedy is the limit anyway
    if params.temperature < MIN_TEMPERATURE:
        return argmax_rows(logits[None])[0]
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= params.top_p  # keeps at least one
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    generator = torch.Generator(device=probs.device).manual_seed(step_seed(params.seed, position))
    return int(torch.multinomial(probs, 1, generator=generator))


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy, one choice, no logprobs: the argmax of its (shaped) logits is all the request asks
    of them."""
    return params.temperature < MIN_TEMPERATURE and params.n == 1 and not params.logprobs


def greedy_tokens(logits: torch.Tensor, wanted: list[bool]) -> list[int]:
    """The argmax of each row of logits [rows, vocab] that is `wanted`, in one call (row by
    row, each costs a call of its own); -1 for the others. The same tokens as sample()."""
    if not any(wanted):
        return [-1] * len(wanted)
    picked = argmax_rows(logits[: len(wanted)])
    return [token if want else -1 for token, want in zip(picked, wanted)]


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The first index of each row's largest value. On a CPU, numpy's (vectorized: a 32 x 49k
    batch in ~0.1 ms, where torch.argmax takes ~1.5 ms); bf16 rows widened first, exactly."""
    if logits.device.type != "cpu":
        return torch.argmax(logits, dim=-1).tolist()
    return logits.detach().float().numpy().argmax(axis=-1).tolist()


def logprob_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under the raw logits [vocab] (no temperature, top-k or top-p:
    the model's own distribution, as OpenAI's API reports it) and the `top` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).clamp_(min=LOWEST_LOGPROB)
    chosen = float(logprobs[token])
    if top <= 0:
        return TokenLogprob(chosen)
    values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
    return TokenLogprob(chosen, ids.tolist(), values.tolist())
