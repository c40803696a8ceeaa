"""Structured outputs at the gateway: a request's StructuredOutput (gRPC) as the Constraint the
workers mask with, checked here by compiling it (on the tokenizer thread, with the grammar
engine's limits), so a constraint that cannot compile, or a hostile one past the limits, is an
INVALID_ARGUMENT (400) before anything is placed. Compiled grammars are cached."""

import json

from services.gateway.invalid import InvalidRequest
from shared.api import tandem_pb2 as pb
from shared.grammar.compiler import BadConstraint, GrammarCompiler
from shared.values.constraint import Constraint, ConstraintKind


def constraint_of(structured: pb.StructuredOutput) -> Constraint:
    kind = structured.WhichOneof("kind")
    if kind == "json_object":
        if not structured.json_object:
            raise InvalidRequest("structured_output.json_object must be true when set")
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "choice":
        choices = list(structured.choice.choices)
        if not choices or not all(choices):
            raise InvalidRequest("structured_output.choice needs at least one non-empty string")
        return Constraint(ConstraintKind.CHOICE, json.dumps(choices))
    if kind is None:
        raise InvalidRequest("structured_output names no kind")
    spec = getattr(structured, kind)
    if not spec:
        raise InvalidRequest(f"structured_output.{kind} is empty")
    return Constraint(ConstraintKind(kind), spec)


class Grammars:
    """The gateway's grammar compiler, made at the first constrained request (its ~0.5 s on the
    tokenizer thread, not at start: most gateways never see one)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None

    def check(self, constraint: Constraint) -> None:
        try:
            if self._compiler is None:  # which tokens end an output matters to a worker's masks,
                ends = [self._tokenizer.eos_token_id]  # not to whether a constraint compiles
                ends = [t for t in ends if t is not None]
                self._compiler = GrammarCompiler(self._tokenizer, ends)
            self._compiler.check(constraint)
        except BadConstraint as err:
            raise InvalidRequest(str(err)) from None
