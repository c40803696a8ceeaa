"""The ranges every control message must keep, checked by wire.decode on receipt.

Types are checked while a message is built; these are the values: a count is never negative, a
time or a rate is a finite number (a difference of two hosts' clocks may be negative), a string
or a list has a bounded size, and a few fields have ranges of their own (a sampling temperature,
a resume point within its prompt). A message outside them is a MessageError like any malformed
payload: logged, counted, dropped.
"""

import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from typing import Any

MAX_STR = 64 * 1024  # characters of one string field (the largest: a chunk's text)
MAX_LIST = 1 << 20  # items of one list field (the largest: a prompt's token ids)
MAX_UINT = (1 << 64) - 1  # prefix-summary keys are unsigned 64-bit
INT32 = (-(1 << 31), (1 << 31) - 1)
TOKEN_ID_LIMIT = 1 << 31
MAX_TEMPERATURE = 1000.0  # the gateway refuses more (its validation must stay within these)
MAX_TOP_K = 1 << 20
MAX_STOP_STRINGS = 64
MAX_TOP_LOGPROBS = 20  # alternatives per position, as OpenAI's API allows
MAX_N = 64  # choices of one request
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's API allows
MAX_REPETITION_PENALTY = 100.0  # in (0, this]: vLLM takes any positive number; finite here
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100], as OpenAI's API allows
MAX_BIAS_TOKENS = 1024  # tokens one request's logit bias names
MAX_MESSAGES = 4096  # chat messages of one request (gateway: counted before any rendering)
MAX_CONTENT_PARTS = 4096  # text parts of one request's messages, all messages together
MAX_LABEL = 256  # characters of a worker's descriptive strings (its kernel report)
MAX_TP = 1024  # tensor-parallel ranks of one worker
MAX_PARTNERS = 64  # prefill workers one decode worker's room names

# int fields that may be negative, and how far
SIGNED = {
    ("GenerateTask", "priority"): INT32,
}
TOKEN_LISTS = {"prompt_token_ids", "token_ids", "top_ids", "first_tokens", "bias_token_ids"}


def _sampling(m) -> str | None:
    if not 1 <= m.max_tokens <= MAX_LIST:
        return "max_tokens out of range"
    if (
        not 0 <= m.temperature <= MAX_TEMPERATURE
        or not 0 < m.top_p <= 1
        or m.top_k > MAX_TOP_K
        or len(m.stop) > MAX_STOP_STRINGS
        or m.top_logprobs > MAX_TOP_LOGPROBS
        or not 1 <= m.n <= MAX_N
    ):
        return "sampling parameters out of range"
    return _penalties(m)


def _penalties(m) -> str | None:
    if (
        not -MAX_PENALTY <= m.presence_penalty <= MAX_PENALTY
        or not -MAX_PENALTY <= m.frequency_penalty <= MAX_PENALTY
        or not 0 < m.repetition_penalty <= MAX_REPETITION_PENALTY
        or m.min_tokens > m.max_tokens
    ):
        return "penalties or min_tokens out of range"
    ids, values = m.bias_token_ids, m.bias_values
    if len(ids) != len(values) or len(ids) > MAX_BIAS_TOKENS or len(set(ids)) != len(ids):
        return "bias_token_ids and bias_values differ in length, repeat a token or are too long"
    if not all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in values):  # NaN fails too
        return "bias_values has an item out of range"
    return None


def _logprob(m) -> str | None:
    if len(m.top_ids) != len(m.top_logprobs) or len(m.top_ids) > MAX_TOP_LOGPROBS:
        return "top_ids and top_logprobs differ in length or are too long"
    if not all(math.isfinite(v) for v in m.top_logprobs):
        return "top_logprobs has an item that is not a finite number"
    return None


# what a prompt's logprobs may take of one message (wire.MAX_MESSAGE_BYTES is 1000 KiB): each
# position's logprob (a float64: 9 bytes) and its top ids and logprobs (up to 5 + 9 bytes each)
PROMPT_LOGPROBS_BYTES = 768 * 1024


def prompt_logprobs_fit(prompt_len: int, top: int) -> bool:
    """Whether the prompt logprobs of a prompt of `prompt_len` tokens, `top` alternatives each,
    fit one message."""
    return prompt_len * (9 + 14 * top) <= PROMPT_LOGPROBS_BYTES


def _prompt_logprobs(m) -> str | None:
    rows = len(m.logprobs)
    if not 0 <= m.top <= MAX_TOP_LOGPROBS or not prompt_logprobs_fit(rows, m.top):
        return "prompt logprobs too many"
    if len(m.top_ids) != rows * m.top or len(m.top_logprobs) != rows * m.top:
        return "prompt logprobs' columns differ in length"
    if not all(math.isfinite(v) for v in m.logprobs) or not all(
        math.isfinite(v) for v in m.top_logprobs
    ):
        return "prompt logprobs has an item that is not a finite number"
    return None


def _prefill_result(m) -> str | None:
    if m.failure is None and not m.first_tokens:
        return "a result without its first tokens"
    if m.first_logprobs and len(m.first_logprobs) != len(m.first_tokens):
        return "first_logprobs and first_tokens differ in length"
    return None


def _task(m) -> str | None:
    if not m.attempt_id or not m.prompt_token_ids:
        return "empty attempt id or prompt"
    if m.resume_tokens >= len(m.prompt_token_ids) or len(m.avoid_workers) > 64 or m.moves > 64:
        return "resume_tokens, avoid_workers or moves out of range"
    return None


def _layout(m) -> str | None:
    dims = (m.num_layers, m.num_kv_heads, m.head_dim, m.block_size)
    windows = len(m.windows) <= 65536 and all(0 <= w <= 1 << 30 for w in m.windows)
    return None if all(1 <= d <= 65536 for d in dims) and windows else "KV layout out of range"


def _destination(m) -> str | None:
    degrees = 1 <= m.prefill_tp <= MAX_TP and 1 <= m.decode_tp <= MAX_TP
    return (
        None
        if m.segment_tokens >= 1 and 0 < m.lease_s <= 3600 and degrees
        else "segment_tokens, lease_s or a tensor-parallel degree out of range"
    )


def _heartbeat(m) -> str | None:
    fits = len(m.kernels) <= MAX_LABEL and len(m.model) <= MAX_LABEL
    ranks = 1 <= m.tp <= MAX_TP and len(m.tp_ranks) <= MAX_TP
    ranks = ranks and all(len(r) <= MAX_LABEL for r in m.tp_ranks)
    return None if fits and ranks else "kernels, model or tensor-parallel ranks out of range"


EXTRA: dict[str, Callable[[Any], str | None]] = {
    "SamplingParams": _sampling,
    "TokenLogprob": _logprob,
    "PromptLogprobs": _prompt_logprobs,
    "PrefillResult": _prefill_result,
    "GenerateTask": _task,
    "KVLayout": _layout,
    "KVDestination": _destination,
    "WorkerHeartbeat": _heartbeat,
    "Room": lambda m: (
        None
        if 1 <= m.tp <= MAX_TP and len(m.prefill_workers) <= MAX_PARTNERS
        else "a room's tp or prefill_workers out of range"
    ),
    "DecodeAssignment": lambda m: (
        None if 1 <= m.prefill_tp <= MAX_TP else "prefill_tp out of range"
    ),
}


def _int_check(name: str, low: int, high: int, value: int) -> str | None:
    return None if low <= value <= high else f"{name} out of range"


def _float_check(name: str, value: float) -> str | None:
    # times may differ in sign across hosts' clocks: finite is the rule
    return None if math.isfinite(value) else f"{name} is not a finite number"


def _size_check(name: str, value: str | bytes) -> str | None:
    return None if len(value) <= MAX_STR else f"{name} is too long"


def _list_check(name: str, items: type, value: list) -> str | None:
    if len(value) > MAX_LIST:
        return f"{name} has too many items"
    if items is int and value:
        high = TOKEN_ID_LIMIT - 1 if name in TOKEN_LISTS else MAX_UINT
        if min(value) < 0 or max(value) > high:
            return f"{name} has an item out of range"
    if items is str and any(len(v) > MAX_STR for v in value):
        return f"{name} has an item too long"
    return None


def _field_check(kind: str, name: str, hint: Any) -> Callable[[Any], str | None] | None:
    """The range check of a field of type `hint` (types are checked already); None: none."""
    if hint is int:
        return functools.partial(_int_check, name, *SIGNED.get((kind, name), (0, MAX_UINT)))
    if hint is float:
        return functools.partial(_float_check, name)
    if hint in (str, bytes):
        return functools.partial(_size_check, name)
    if typing.get_origin(hint) is list:
        return functools.partial(_list_check, name, typing.get_args(hint)[0])
    return None  # bool, a nested message (checked as it is built), an enum


@functools.cache
def _checks(cls: type) -> dict[str, Callable[[Any], str | None]]:
    kind, hints = cls.__name__, typing.get_type_hints(cls)
    found = ((f.name, _field_check(kind, f.name, hints[f.name])) for f in dataclasses.fields(cls))
    return {name: check for name, check in found if check is not None}


def problem(message: Any, received: dict | None = None) -> str | None:
    """What is out of range in `message` (not in the messages it holds: each is checked on its
    own). Its fields' types are right already: wire.decode checks them first. `received`: the
    fields the payload carried; only those are checked (the others are their defaults, in
    range)."""
    checks = _checks(type(message))
    for name in checks if received is None else received:
        check = checks.get(name)
        found = check(getattr(message, name)) if check is not None else None
        if found:
            return found
    extra = EXTRA.get(type(message).__name__)
    return extra(message) if extra else None
