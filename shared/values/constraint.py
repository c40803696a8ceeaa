"""Constraint: what a request's output must match (OpenAI's structured outputs and the peers'
guided decoding), as the engine and the control plane both hold it.

A grammar engine (shared/grammar) compiles it for the model's tokenizer and, at each step, masks
the logits of the tokens that cannot continue a valid output: the first token (sampled where the
prompt is computed) and every later one. Nothing of its state travels: a worker that takes a
sequence over (the decode worker after the prefill worker, another after a migration) rebuilds
it from the constraint and the output tokens so far.
"""

from dataclasses import dataclass
from enum import StrEnum

# A next-token mask, as a grammar engine fills it and the engine applies it, is int32 words: bit k
# of word w set where token MASK_WORD * w + k may come next.
MASK_WORD = 32


class ConstraintKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # spec: a JSON schema, as JSON text (response_format json_schema)
    JSON_OBJECT = "json_object"  # any JSON object (response_format json_object); spec: ""
    REGEX = "regex"  # spec: a regular expression the whole output matches
    GRAMMAR = "grammar"  # spec: a context-free grammar in Lark's syntax (llguidance's dialect)
    CHOICE = "choice"  # spec: a JSON list of strings; the output is exactly one of them


@dataclass
class Constraint:
    kind: ConstraintKind
    spec: str = ""
