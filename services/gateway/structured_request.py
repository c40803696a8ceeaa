"""The structured output an OpenAI body asks for, as the gRPC API's StructuredOutput.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with its `schema`; `strict` is
how it is served anyway: the output always matches), and vLLM's extensions, which clients send
through `extra_body`: `structured_outputs` with one of `json` (a schema), `regex`, `grammar` (Lark
syntax, llguidance's dialect), `choice` (a list of strings), and the older `guided_json`,
`guided_regex`, `guided_grammar` and `guided_choice`. One request asks for one at most.
"""

import json
from typing import Any

from services.gateway.body_fields import BadRequest
from shared.api import tandem_pb2 as pb

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar"}
GUIDED["guided_choice"] = "choice"


def structured_output(body: dict) -> pb.StructuredOutput | None:
    """The one constraint the body asks for (None: none); BadRequest naming the field at fault."""
    asked = [(name, body.get(name)) for name in ("response_format", "structured_outputs", *GUIDED)]
    asked = [(name, value) for name, value in asked if value is not None]
    made = [(name, _made(name, value)) for name, value in asked]
    made = [(name, out) for name, out in made if out is not None]
    if len(made) > 1:
        raise BadRequest(f"ask for one structured output, not {len(made)}", made[1][0])
    return made[0][1] if made else None


def _made(name: str, value: Any) -> pb.StructuredOutput | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict) or len(value) != 1:
            raise BadRequest("structured_outputs takes one of json, regex, grammar, choice", name)
        ((kind, spec),) = value.items()
        return _guided(kind, spec, f"{name}.{kind}")
    return _guided(GUIDED[name], value, name)


def _response_format(value: Any) -> pb.StructuredOutput | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, (dict, bool)):
            raise BadRequest(
                "response_format.json_schema.schema must be a JSON schema", "response_format"
            )
        return pb.StructuredOutput(json_schema=json.dumps(schema))
    raise BadRequest(
        "response_format.type must be text, json_object or json_schema", "response_format"
    )


def _guided(kind: str, spec: Any, param: str) -> pb.StructuredOutput:
    if kind == "json" and isinstance(spec, (dict, bool)):
        return pb.StructuredOutput(json_schema=json.dumps(spec))
    if kind == "json" and isinstance(spec, str):
        return pb.StructuredOutput(json_schema=spec)
    if kind in ("regex", "grammar") and isinstance(spec, str) and spec:
        return pb.StructuredOutput(**{kind: spec})
    if (
        kind == "choice"
        and isinstance(spec, list)
        and spec
        and all(isinstance(c, str) and c for c in spec)
    ):
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=spec))
    raise BadRequest(f"{param}: not a {kind} this server takes", param)
