"""GrammarCompiler: a Constraint as llguidance's grammar, checked against its limits, compiled
once per tokenizer and kept (the same schema is asked for again and again: an SDK sends one per
Pydantic model).

Both the gateway and the workers compile: the gateway refuses a constraint that cannot compile,
or is past the limits, with INVALID_ARGUMENT before anything is placed (a hostile schema or regex
costs a 400, never a stuck worker); a worker compiles what the gateway let through. llguidance's
parser limits bound what one compile and one mask may cost (its lexer fuel per step, its items
per step, the grammar's size): a grammar past them is an error, not a slow step. The spec itself
is bounded by the wire's string limit (64 KiB).
"""

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
from llguidance import LLMatcher, LLParserLimits

from shared.grammar.state import GrammarMasker, GrammarState
from shared.values.constraint import Constraint, ConstraintKind

CACHE = 256  # compiled grammars kept, least recently used out first
# JSON as models write it: compact, spaced or indented (compact only would force a model that
# spaces its JSON off its habits), with at most 32 whitespace characters in a row, so a model
# cannot loop on whitespace; escapes of any code point
JSON_OPTIONS = {
    "whitespace_flexible": True,
    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}",
    "json_allow_general_unicode_escapes": True,
}


class BadConstraint(ValueError):
    """A constraint that is not valid, or is past the grammar engine's limits."""


class GrammarCompiler:
    """Compiles constraints for one tokenizer: `hf_tokenizer` (Hugging Face's), `eos_ids` (the
    tokens that end an output: the mask allows them once the output is complete). The mask covers
    the tokenizer's ids; logits rows past them (a model's padded vocabulary) are never allowed.
    `threads`: how many threads compute a step's masks (a worker's torch threads)."""

    def __init__(self, hf_tokenizer, eos_ids, threads: int = 1):
        self.eos_ids = sorted(eos_ids)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=self.eos_ids)
        except Exception as err:  # a tokenizer llguidance cannot read (not byte-level BPE, ...)
            why = f"this model's tokenizer cannot be used for structured outputs: {err}"
            raise BadConstraint(why) from None
        self.limits = LLParserLimits()
        self.masker = GrammarMasker(self.tokenizer.vocab_size, self.eos_ids, threads)
        self._compiled: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the gateway validates on a thread pool

    def check(self, constraint: Constraint) -> None:
        """Raises BadConstraint when `constraint` cannot be compiled within the limits."""
        self._template(constraint)

    def state(self, constraint: Constraint, output: list[int]) -> GrammarState:
        """A sequence's state under `constraint`, after `output` (the tokens it has produced so
        far: a moved stream's, or the first token sampled on another worker)."""
        matcher = self._template(constraint).deep_copy()
        state = GrammarState(matcher, self.masker)
        for token in output:
            state.accept(token)
        return state

    def _template(self, constraint: Constraint) -> LLMatcher:
        key = (constraint.kind.value, constraint.spec)
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                return found
        made = self._compile(constraint)
        with self._lock:
            self._compiled[key] = made
            while len(self._compiled) > CACHE:
                self._compiled.popitem(last=False)
        return made

    def _compile(self, constraint: Constraint) -> LLMatcher:
        grammar = grammar_of(constraint)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
        if error:
            raise BadConstraint(f"the {constraint.kind.value} cannot be used: {_first_line(error)}")
        matcher = LLMatcher(self.tokenizer, grammar, limits=self.limits, log_level=0)
        if matcher.is_error():
            why = _first_line(matcher.get_error())
            raise BadConstraint(f"the {constraint.kind.value} cannot be used: {why}")
        return matcher


def grammar_of(constraint: Constraint) -> str:
    """llguidance's grammar (a JSON text) for `constraint`; BadConstraint when its spec is not
    what its kind takes."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind is ConstraintKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(_schema(spec), defaults=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return LLMatcher.grammar_from_regex(spec)
        if kind is ConstraintKind.GRAMMAR:
            return LLMatcher.grammar_from_lark(spec)
        return LLMatcher.grammar_from_lark(_choice_grammar(spec))
    except BadConstraint:
        raise
    except Exception as err:  # llguidance raises ValueError and its own for a bad spec
        raise BadConstraint(f"the {kind.value} cannot be used: {_first_line(str(err))}") from None


def _schema(spec: str) -> dict | bool:
    try:
        schema = json.loads(spec)
    except ValueError as err:
        raise BadConstraint(f"the json_schema is not JSON: {err}") from None
    except RecursionError:
        raise BadConstraint("the json_schema is nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise BadConstraint("the json_schema must be a JSON object")
    return schema


def _choice_grammar(spec: str) -> str:
    """A Lark grammar whose only sentences are the choices (a JSON list of strings)."""
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise BadConstraint("a choice constraint is a non-empty list of strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "rejected"
