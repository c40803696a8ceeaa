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
import msgspec

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
        if not value or type(value[0]) in _SCALARS:
            return value
        first, convert = type(value[0]), _converter(type(value[0]))
        return [convert(v) if type(v) is first else _to_plain(v) for v in value]
    return _converter(kind)(value)


def _same(value: Any) -> Any:
    return value


def _enum_value(value: enum.Enum) -> Any:
    return value.value


@functools.cache
def _converter(kind: type) -> typing.Callable[[Any], Any]:
    """How a value of a type that is neither a scalar nor a list travels (looked up once)."""
    if issubclass(kind, enum.Enum):
        return _enum_value
    if dataclasses.is_dataclass(kind):
        return _body_of(kind)
    return _same


_TRAVELLING = {  # how a field's value travels, as an expression of it (v)
    "plain": "v",
    "nested": "_to_plain(v)",
    "packed": "_pack(v)",
    "deadline": "_time_left(v) if v else v",  # the time left (0: none)
}


@functools.cache
def _body_of(cls: type) -> typing.Callable[[Any], dict]:
    """The function that makes a message of `cls` a plain map: each field as _TRAVELLING says,
    left out where it equals its default (the receiver's dataclass gives it back: most of a
    chunk's fields). Written once per type from its layout, as dataclasses writes __init__ (a
    loop over the layout cost ~1.35 us a token chunk, this ~0.45)."""
    lines, env = ["def body_of(value):", "    body = {}"], {}
    env.update(_to_plain=_to_plain, _pack=_pack, _time_left=_time_left)
    for i, (name, how, default) in enumerate(_layout(cls)):
        if not name.isidentifier():
            raise TypeError(f"{cls.__name__}.{name} is not a field name")
        env[f"d{i}"], env[f"t{i}"] = default, type(default)
        lines += [
            f"    v = value.{name}",
            f"    if not (v == d{i} and type(v) is t{i}):",
            f"        body[{name!r}] = {_TRAVELLING[how]}",
        ]
    exec("\n".join(lines + ["    return body"]), env)  # noqa: S102 (our own fields' names)
    return env["body_of"]


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


@functools.cache
def _inner(hint: Any) -> type | None:
    """The message type a field of type `hint` holds (itself, in a list or optional); None for a
    scalar, a list of scalars or an enum."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType, list):
        kinds = [_inner(a) for a in typing.get_args(hint) if a is not type(None)]
        return kinds[0] if kinds else None
    return hint if dataclasses.is_dataclass(hint) else None


@functools.cache
def _fixups(cls: type) -> tuple[tuple[str, str, type | None], ...]:
    """The fields of a message type whose travelling form is not their own, each with how
    ("packed", "deadline"), and those holding messages that have such fields ("nested", with
    the type): what _receive must turn back before the typed conversion. Made once per type."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        inner = _inner(hints[f.name])
        if _travels(f.name):
            found.append((f.name, _travels(f.name), None))
        elif inner is not None and _fixups(inner):
            found.append((f.name, "nested", inner))
    return tuple(found)


def _receive(cls: type, body: dict, where: str) -> None:
    """Turns `body`'s packed token ids and deadlines (the time left) back into their own form,
    in place, in it and in the messages it holds."""
    for name, how, inner in _fixups(cls):
        value = body.get(name)
        if how == "packed" and isinstance(value, bytes):
            body[name] = _unpack(value, f"{where}.{name}")
        elif how == "deadline" and isinstance(value, float) and value:
            body[name] = _now() + value  # the time left, as an instant of this host's clock
        elif how == "nested" and inner is not None:
            for item in value if isinstance(value, list) else (value,):
                if isinstance(item, dict):
                    _receive(inner, item, f"{where}.{name}")


_DECODER = msgspec.msgpack.Decoder()  # untyped: the type is read first, then converted to
_BYTES = (bytes, bytearray)  # kept as they are by msgspec.convert


def decode(data: bytes, expected: type[M] | None = None) -> M:
    """The only way bytes become a message; `expected` narrows which type is acceptable. Types
    and ranges are checked by msgspec (in C: a bool is no int, an int is a float; rules.ranged),
    then the rules of a few messages' own (rules.EXTRA)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"payload of {len(data)} bytes is over the limit")
    try:
        body = _DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise MessageError(f"not msgpack: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise MessageError("not a typed message")
    cls = MESSAGE_TYPES.get(body.pop("type"))
    if cls is None:
        raise MessageError("unknown message type")
    if expected is not None and cls is not expected:
        raise MessageError(f"expected {expected.__name__}, got {cls.__name__}")
    _receive(cls, body, cls.__name__)
    try:  # types and ranges first (a mirror with msgspec's constraints), then the message itself
        msgspec.convert(body, message_rules.ranged(cls), strict=True, builtin_types=_BYTES)
        message = msgspec.convert(body, cls, strict=True, builtin_types=_BYTES)
    except msgspec.ValidationError as exc:  # a missing, mistyped or out-of-range field, an
        raise MessageError(f"{cls.__name__}: {exc}") from None  # unknown enum value
    found = message_rules.problem(message, body, cls.__name__)
    if found:
        raise MessageError(found)
    return message
