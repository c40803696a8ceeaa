"""The ranges every control message must keep, checked by wire.decode on receipt.

Types are checked while a message is built; these are the values: a count is never negative, a
time or a rate is a finite number (a difference of two hosts' clocks may be negative), a string
or a list has a bounded size (all of these as msgspec constraints on a mirror of each message,
`ranged`: checked in C as a payload converts), and a few fields have rules of their own (EXTRA:
a sampling temperature, a resume point within its prompt), checked in Python after it. A message
outside them is a MessageError like any malformed payload: logged, counted, dropped.
"""

import dataclasses
import functools
import math
import sys
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

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


# a finite float: NaN fails both bounds, an infinity one
_FINITE = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
_INT64_MAX = (1 << 63) - 1  # msgspec bounds an int within int64; msgpack's ints end at uint64


def _int(low: int, high: int) -> Any:
    bounds = {"ge": low} if high > _INT64_MAX else {"ge": low, "le": high}
    return Annotated[int, msgspec.Meta(**bounds)]


def _field_range(kind: str, name: str, hint: Any) -> Any:
    """`hint` with its range as msgspec constraints (checked in C while a payload is converted):
    a count within 0..MAX_UINT (SIGNED: its own range), a time or a rate finite, a string or
    bytes at most MAX_STR long, a list at most MAX_LIST items (a token id below
    TOKEN_ID_LIMIT, any other int not negative, a string at most MAX_STR), a message's fields
    within theirs; a bool or an enum as it is."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is int:
        return _int(*SIGNED.get((kind, name), (0, MAX_UINT)))
    if hint is float:
        return _FINITE
    if hint in (str, bytes):
        return Annotated[hint, msgspec.Meta(max_length=MAX_STR)]
    if origin is list:
        item = args[0]
        if item is int:
            item = _int(0, TOKEN_ID_LIMIT - 1 if name in TOKEN_LISTS else MAX_UINT)
        elif item is str:
            item = Annotated[str, msgspec.Meta(max_length=MAX_STR)]
        elif dataclasses.is_dataclass(item):
            item = ranged(item)
        return Annotated[list[item], msgspec.Meta(max_length=MAX_LIST)]
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_field_range(kind, name, a) for a in args)]  # noqa: UP007
    if dataclasses.is_dataclass(hint):
        return ranged(hint)
    return hint  # bool, an enum, None


@functools.cache
def ranged(cls: type) -> type:
    """A msgspec Struct with `cls`'s fields, each within its range (_field_range): a payload
    converted to it is checked, types and ranges, without a line of Python per field. Its
    fields' defaults are never read (a field left out is the message's default, in range)."""
    kind, hints = cls.__name__, typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        ranged_type = _field_range(kind, f.name, hints[f.name])
        optional = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        fields.append((f.name, ranged_type, None) if optional else (f.name, ranged_type))
    return msgspec.defstruct(f"{kind}InRange", fields, kw_only=True)


@functools.cache
def _carries_extra(cls: type) -> bool:
    """Whether `cls` or a message it may hold has a rule of its own (EXTRA)."""
    if cls.__name__ in EXTRA:
        return True
    return any(_carries_extra(inner) for _, inner, _ in held(cls))


def _message_in(hint: Any) -> tuple[type | None, bool]:
    """The message type a field of type `hint` holds (itself, in a list, optional: None for
    none) and whether in a list."""
    origin = typing.get_origin(hint)
    if origin is list:
        return _message_in(typing.get_args(hint)[0])[0], True
    if origin in (typing.Union, types.UnionType):
        found = [_message_in(a) for a in typing.get_args(hint)]
        return next(((kind, many) for kind, many in found if kind is not None), (None, False))
    return (hint, False) if dataclasses.is_dataclass(hint) else (None, False)


@functools.cache
def held(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """The fields of `cls` that hold messages: (name, the message type, as a list)."""
    hints = typing.get_type_hints(cls)
    found = ((f.name, *_message_in(hints[f.name])) for f in dataclasses.fields(cls))
    return tuple((name, kind, many) for name, kind, many in found if kind is not None)


@functools.cache
def _extra_plan(cls: type) -> tuple[tuple[tuple[str, bool], ...], Callable | None]:
    """Of `cls`: the fields holding messages that may carry a rule of their own (as a list or
    not), and its own rule (EXTRA; None: none)."""
    fields = tuple((name, many) for name, inner, many in held(cls) if _carries_extra(inner))
    return fields, EXTRA.get(cls.__name__)


def problem(message: Any, received: dict, where: str) -> str | None:
    """What breaks a rule of its own (EXTRA) in `message` or a message it holds, where; its
    fields' types and ranges are right already (wire.decode converts the payload to `ranged`
    first). `received`: what the payload carried of it (a field left out is its default)."""
    fields, extra = _extra_plan(type(message))
    for name, many in fields:
        carried = received.get(name)
        if carried is None:
            continue
        value = getattr(message, name)
        if value is None:
            continue
        for item, its in zip(value, carried) if many else ((value, carried),):
            found = None if item is None else problem(item, its, f"{where}.{name}")
            if found:
                return found
    found = extra(message) if extra else None
    return f"{where}: {found}" if found else None
