"""The one place control messages are encoded to and decoded from msgpack.

A message is a map with its type name under "type"; unknown types, missing or mistyped fields,
values out of range (shared.control.rules) and oversized payloads are rejected with MessageError.
"""

import array
import dataclasses
import enum
import functools
import sys
import time
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from shared.control import rules as message_rules
from shared.control.messages import MESSAGE_TYPES

# NATS refuses payloads over its max_payload (1 MiB by default). Stay below it so a message
# that grows with its input fails here, loudly, instead of as a timeout there. A prompt's token
# ids travel packed (PACKED): 4 bytes each, so a 128k-token prompt takes 512 KiB of it.
MAX_MESSAGE_BYTES = 1000 * 1024
PACKED = {"prompt_token_ids"}  # list[int] fields sent as little-endian uint32 bytes
_UINT32 = "I" if array.array("I").itemsize == 4 else "L"
# Deadlines are instants of the local clock (unix time; 0: none) in a process, and travel as the
# time left (seconds; negative: passed): hosts' clocks may disagree, a duration does not care.
DEADLINES = {"deadline"}
PASSED_S = -1e-3  # what a deadline already passed travels as (0 would read as "none")

M = TypeVar("M")


class MessageError(ValueError):
    """A payload that is not a valid Tandem message."""


def _now() -> float:
    return time.time()


def _time_left(deadline: float) -> float:
    left = deadline - _now()
    return left if left > 0 else min(left, PASSED_S)


def _pack(ids: list[int]) -> bytes:
    try:
        packed = array.array(_UINT32, ids)
    except (OverflowError, TypeError) as err:
        raise MessageError(f"token ids must be uint32: {err}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes, where: str) -> list[int]:
    if len(data) % 4:
        raise MessageError(f"{where}: packed token ids are not a whole number of uint32")
    ids = array.array(_UINT32)
    ids.frombytes(data)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def _travels(name: str) -> str:
    return "packed" if name in PACKED else "deadline" if name in DEADLINES else ""


def _plain_type(hint: Any) -> bool:
    """A field of this type goes to msgpack as it is (a scalar, or a list of scalars)."""
    if typing.get_origin(hint) is list:
        hint = typing.get_args(hint)[0]
    return hint in _SCALARS


_SENT = object()  # a field with no default that may be left out: always sent


def _default(f: dataclasses.Field) -> Any:
    """What a field may be left out at (the receiver's dataclass gives it back): a scalar or None
    default, or an empty list's factory; _SENT for any other."""
    if f.default is not dataclasses.MISSING and type(f.default) in _SCALARS:
        return f.default
    if f.default_factory is list:
        return []
    return _SENT


@functools.cache
def _layout(cls: type) -> tuple[tuple[str, str, Any], ...]:
    """Each field of a message type, how it is encoded: "plain" (as it is), "packed",
    "deadline", or "nested" (messages, enums: converted in turn), and the default it is left out
    at. Made once per type."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            _travels(f.name) or ("plain" if _plain_type(hints[f.name]) else "nested"),
            _default(f),
        )
        for f in dataclasses.fields(cls)
    )


def _to_plain(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:  # a message's lists hold one type: scalars go as they are
        return value if not value or type(value[0]) in _SCALARS else [_to_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if not dataclasses.is_dataclass(value):
        return value
    body = {}
    for name, how, default in _layout(kind):
        field_value = getattr(value, name)
        if field_value == default and type(field_value) is type(default):
            continue  # left out: the receiver's default is the same (most of a chunk's fields)
        if how == "plain":
            body[name] = field_value
        elif how == "nested":
            body[name] = _to_plain(field_value)
        elif how == "packed":
            body[name] = _pack(field_value)
        else:  # a deadline: the time left (0: none)
            body[name] = _time_left(field_value) if field_value else field_value
    return body


def encode(message: Any) -> bytes:
    """The only way a message becomes bytes."""
    name = type(message).__name__
    if MESSAGE_TYPES.get(name) is not type(message):
        raise MessageError(f"not a wire message: {name}")
    body = _to_plain(message)
    body["type"] = name
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{name} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")
    return data


Convert = Callable[[Any, str], Any]  # a field's value as received -> as typed, or MessageError


def _int(value: Any, where: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, bool):
        raise MessageError(f"{where}: expected int, got bool")
    if isinstance(value, int):
        return value
    raise MessageError(f"{where}: expected int, got {type(value).__name__}")


def _float(value: Any, where: str) -> float:
    if type(value) is float:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, float):
        return value
    raise MessageError(f"{where}: expected float, got {type(value).__name__}")


def _plain(kind: type, value: Any, where: str) -> Any:
    if not isinstance(value, kind):
        raise MessageError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _enum(kind: type, value: Any, where: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise MessageError(f"{where}: not a {kind.__name__}: {str(value)[:40]!r}") from None


def _message(cls: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise MessageError(f"{where}: expected a map")
    return _build(cls, value, where)


def _optional(convert: Convert, value: Any, where: str) -> Any:
    return None if value is None else convert(value, where)


def _list(convert: Convert, exact: type | None, value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise MessageError(f"{where}: expected a list")
    if exact is None:
        return [convert(v, f"{where}[]") for v in value]
    for v in value:  # msgpack gives exactly int/str/bytes: only an odd item is looked at closer
        if type(v) is not exact:
            convert(v, f"{where}[]")
    return value


@functools.cache
def _converter(kind: Any) -> Convert:
    """The check and conversion of a value of type `kind`, made once per type."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        inner = _converter([a for a in args if a is not type(None)][0])
        return functools.partial(_optional, inner) if type(None) in args else inner
    if origin is list:
        (item,) = typing.get_args(kind)
        exact = item if item in (int, str, bytes) else None
        return functools.partial(_list, _converter(item), exact)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return functools.partial(_enum, kind)
    if dataclasses.is_dataclass(kind):
        return functools.partial(_message, kind)
    if kind is int or kind is float:
        return _int if kind is int else _float
    return functools.partial(_plain, kind)


@functools.cache
def _plan(cls: type) -> tuple[dict[str, tuple[Convert, str, type | None]], tuple[str, ...]]:
    """Each field of a message type by name: its converter, how it travels ("packed",
    "deadline" or ""), and its type when a value of exactly that type is taken as it is (int,
    str, bool, bytes, float; else None); and the required fields, in order. Made once per type:
    resolving costs more than decoding."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    plan = {
        f.name: (
            _converter(hints[f.name]),
            _travels(f.name),
            hints[f.name] if hints[f.name] in (int, str, bool, bytes, float) else None,
        )
        for f in fields
    }
    required = tuple(
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    return plan, required


def _build(cls: type, body: dict, where: str) -> Any:
    """The message of type `cls` from the fields `body` carries (others are left at their
    defaults: the sender leaves those out; a name the type lacks is ignored)."""
    plan, required = _plan(cls)
    values = {}
    for name, value in body.items():
        known = plan.get(name)
        if known is None:
            continue
        convert, travels, exact = known
        if type(value) is exact and not travels:
            values[name] = value  # what the converter would return, unchanged
            continue
        if travels == "packed" and isinstance(value, bytes):
            value = _unpack(value, f"{where}.{name}")
        elif travels == "deadline" and isinstance(value, float) and value:
            value = _now() + value  # the time left, as an instant of this host's clock
        values[name] = convert(value, f"{where}.{name}")
    for name in required:
        if name not in values:
            raise MessageError(f"{where}: missing field {name!r}")
    message = cls(**values)
    found = message_rules.problem(message, values)
    if found:
        raise MessageError(f"{where}: {found}")
    return message


def decode(data: bytes, expected: type[M] | None = None) -> M:
    """The only way bytes become a message; `expected` narrows which type is acceptable."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"payload of {len(data)} bytes is over the limit")
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_map_len=256,
            max_array_len=message_rules.MAX_LIST,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"not msgpack: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise MessageError("not a typed message")
    cls = MESSAGE_TYPES.get(body.pop("type"))
    if cls is None:
        raise MessageError("unknown message type")
    if expected is not None and cls is not expected:
        raise MessageError(f"expected {expected.__name__}, got {cls.__name__}")
    return _build(cls, body, cls.__name__)
