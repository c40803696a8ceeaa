"""The JSON schema a tool_choice of `required` or a named function constrains the output to, as
vLLM builds it, so the grammar engine makes every call's arguments valid for its tool's schema.

- `required`: an array of at least one call (at most one when parallel_tool_calls is false),
  each `{"name": <one tool's name>, "parameters": <that tool's parameters>}` and nothing else:
  one alternative (anyOf) per tool, so a name goes with its own tool's parameters.
- a named function: that function's parameters object alone (its arguments).

A tool without parameters takes an object of any properties. The tools' `$defs` move to the
root, where their `#/$defs/...` references point (two tools defining one name differently are
refused).
"""

import json

from services.gateway.invalid import InvalidRequest
from services.gateway.tool_request import FUNCTION, REQUIRED, parameters_of
from shared.api import tandem_pb2 as pb
from shared.values.constraint import Constraint, ConstraintKind

ANY_OBJECT = {"type": "object", "properties": {}}


def tool_constraint(request: pb.GenerateRequest) -> Constraint | None:
    """What the output must match for the request's tool choice; None with auto or none."""
    mode = request.tool_choice.mode
    if not request.tools or mode not in (REQUIRED, FUNCTION):
        return None
    if mode == FUNCTION:
        (tool,) = [t for t in request.tools if t.name == request.tool_choice.function]
        schema = parameters_of(tool) or ANY_OBJECT
    else:
        parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
        schema = calls_schema(list(request.tools), parallel)
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))


def calls_schema(tools: list[pb.Tool], parallel: bool) -> dict:
    """`required`'s array of calls."""
    defs: dict = {}
    alternatives = []
    for tool in tools:
        parameters = dict(parameters_of(tool) or ANY_OBJECT)
        _move_defs(parameters, defs, tool.name)
        alternatives.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,  # else a grammar lets the model add keys forever
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _move_defs(parameters: dict, defs: dict, name: str) -> None:
    for key, value in (parameters.pop("$defs", None) or {}).items():
        if key in defs and defs[key] != value:
            raise InvalidRequest(f"tools: {name} defines $defs {key!r} unlike another tool does")
        defs[key] = value
