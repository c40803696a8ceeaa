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


def _to_plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        body = {}
        for f in dataclasses.fields(value):
            field_value = getattr(value, f.name)
            if f.name in PACKED:
                body[f.name] = _pack(field_value)
            elif f.name in DEADLINES and field_value:
                body[f.name] = _time_left(field_value)
            else:
                body[f.name] = _to_plain(field_value)
        return body
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return value


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


def _check(kind: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(kind):
            return None
        inner = [a for a in typing.get_args(kind) if a is not type(None)][0]
        return _check(inner, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list")
        (item,) = typing.get_args(kind)
        return [_check(item, v, f"{where}[]") for v in value]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise MessageError(f"{where}: not a {kind.__name__}: {str(value)[:40]!r}") from None
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected a map")
        return _build(kind, value, where)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool):
        raise MessageError(f"{where}: expected int, got bool")
    if not isinstance(value, kind):
        raise MessageError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    return value


@functools.cache
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """Each field of a message type with its resolved type (resolving costs more than decoding)."""
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def _build(cls: type, body: dict, where: str) -> Any:
    values = {}
    for f, kind in _fields(cls):
        if f.name in body:
            value = body[f.name]
            if f.name in PACKED and isinstance(value, bytes):
                value = _unpack(value, f"{where}.{f.name}")
            elif f.name in DEADLINES and isinstance(value, float) and value:
                value = _now() + value  # the time left, as an instant of this host's clock
            values[f.name] = _check(kind, value, f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MessageError(f"{where}: missing field {f.name!r}")
    message = cls(**values)
    found = message_rules.problem(message)
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
