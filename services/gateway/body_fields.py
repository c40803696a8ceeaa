"""An OpenAI body's fields read one at a time: each with its type and range checked, or a
BadRequest (a 400 with OpenAI's error body) naming it."""

import math

from services.gateway.validation import InvalidRequest, Limits, refuse_oversized


class BadRequest(ValueError):
    """An invalid body: a 400 with OpenAI's error body; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def fits(messages: int, chars: int, limits: Limits, param: str) -> None:
    try:
        refuse_oversized(messages, chars, limits)
    except InvalidRequest as err:
        raise BadRequest(str(err), param) from None


def flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false", name)
    return value


def integer(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{name} must be an integer in [{low}, {high}]", name)
    return value


def number_in(
    body: dict, name: str, default: float, low: float, high: float, param: str = ""
) -> float:
    """body[name], a number in [low, high] (`param`: the field to name, when not `name`)."""
    value = number(body, name, default, param)
    if not low <= value <= high:
        where = f"{param}[{name!r}]" if param else name
        raise BadRequest(f"{where} must be a number in [{low:g}, {high:g}]", param or name)
    return value


def number(body: dict, name: str, default: float, param: str = "") -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        where = f"{param}[{name!r}]" if param else name
        raise BadRequest(f"{where} must be a number", param or name)
    return float(value)
