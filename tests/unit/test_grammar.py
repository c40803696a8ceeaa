"""Structured outputs' grammars (llguidance) on SmolLM2's tokenizer: a constraint compiled once,
a sequence's state that masks every token, rebuilt from the output so far, forked per choice;
bad and hostile constraints refused quickly."""

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from shared.control.failure import Code
from shared.engine import kernels as cpu_kernels
from shared.engine.token_mask import RowMasks
from shared.grammar.compiler import BadConstraint, GrammarCompiler
from shared.values.constraint import Constraint, ConstraintKind
from shared.worker.runtime import constrained

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "size", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, [tokenizer.eos_token_id])


def masked(state, logits: torch.Tensor) -> torch.Tensor:
    """The row as the engine masks it (its masker's bitmask through RowMasks, with the CPU
    kernels where they are built)."""
    [(_, rows)] = RowMasks(cpu_kernels.load()).masked(logits[None], [(0, state)])
    return rows[0]


def walk(state, tokenizer, seed: int, steps: int = 200) -> list[int]:
    """A random walk under the mask: random logits, the best allowed token each step."""
    generator, out = torch.Generator().manual_seed(seed), []
    while not state.finished and len(out) < steps:
        logits = torch.randn(len(tokenizer), generator=generator)
        token = int(masked(state, logits).argmax())
        state.accept(token)
        out.append(token)
    return out


def test_random_walks_under_a_schema_end_in_valid_json(compiler, tokenizer):
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    for seed in range(5):
        state = compiler.state(constraint, [])
        out = walk(state, tokenizer, seed)
        assert state.finished  # complete: nothing but the end may follow
        text = tokenizer.decode(out, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_state_rebuilt_from_the_output_so_far_goes_on_as_the_first_did(compiler, tokenizer):
    constraint = Constraint(ConstraintKind.JSON_OBJECT)
    first = compiler.state(constraint, [])
    prefix = tokenizer.encode('{"a": [1, 2')
    for token in prefix:
        first.accept(token)
    rebuilt, fork = compiler.state(constraint, prefix), first.fork()
    logits = torch.randn(len(tokenizer))
    assert torch.equal(masked(first, logits), masked(rebuilt, logits))
    fork.accept(tokenizer.encode("]")[0])  # a choice's own: the others do not see it
    assert torch.equal(masked(first, logits), masked(rebuilt, logits))
    assert not torch.equal(masked(first, logits), masked(fork, logits))


def test_regex_and_choice_outputs_match(compiler, tokenizer):
    regex = compiler.state(Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]{2}"), [])
    text = tokenizer.decode(walk(regex, tokenizer, 1), skip_special_tokens=True)
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    choices = ["yes", "no", "maybe later"]
    choice = compiler.state(Constraint(ConstraintKind.CHOICE, json.dumps(choices)), [])
    assert tokenizer.decode(walk(choice, tokenizer, 2), skip_special_tokens=True) in choices


def test_a_token_the_mask_forbids_ends_the_state_and_then_only_the_end_is_allowed(
    compiler, tokenizer
):
    state = compiler.state(Constraint(ConstraintKind.JSON_OBJECT), [])
    state.accept(tokenizer.encode("hello")[0])  # not JSON: sampled where no mask applied
    assert state.finished
    row = masked(state, torch.zeros(len(tokenizer) + 64))  # a model's padded vocabulary
    assert torch.isfinite(row).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_a_constraint_compiles_once(compiler):
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "integer"}))
    compiler.check(constraint)
    started = time.perf_counter()
    for _ in range(100):
        compiler.state(constraint, [])
    assert compiler._template(constraint) is compiler._template(constraint)
    print(f"100 states of a cached grammar: {(time.perf_counter() - started) * 1e3:.1f} ms")


def deep(levels: int) -> str:
    """A schema of objects nested `levels` deep, as text (json.dumps recurses too deep)."""
    opening = '{"type": "object", "required": ["a"], "properties": {"a": '
    return opening * levels + '{"type": "integer"}' + "}}" * levels


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(ConstraintKind.JSON_SCHEMA, "{not json"),
        Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"),
        Constraint(ConstraintKind.JSON_SCHEMA, deep(1000)),
        Constraint(ConstraintKind.JSON_SCHEMA, deep(100_000)),
        Constraint(
            ConstraintKind.JSON_SCHEMA, json.dumps({"enum": [f"v{i}" for i in range(100_000)]})
        ),
        Constraint(ConstraintKind.REGEX, "(unclosed"),
        Constraint(ConstraintKind.GRAMMAR, "start: undefined_rule"),
        Constraint(ConstraintKind.CHOICE, "[]"),
        Constraint(ConstraintKind.CHOICE, '"one"'),
    ],
    ids=[
        "not-json",
        "not-a-schema",
        "nested-1000",
        "nested-100k",
        "enum-100k",
        "regex",
        "lark",
        "no-choice",
        "str",
    ],
)
def test_bad_and_hostile_constraints_are_refused_within_a_second(compiler, constraint):
    started = time.perf_counter()
    with pytest.raises(BadConstraint):
        compiler.check(constraint)
    assert time.perf_counter() - started < 1.0


def test_the_gateway_maps_each_structured_output_and_refuses_what_cannot_compile(tokenizer):
    from services.gateway.constraints import Grammars, constraint_of
    from services.gateway.invalid import InvalidRequest
    from shared.api import tandem_pb2 as pb

    grammars = Grammars(tokenizer)
    made = [
        constraint_of(pb.StructuredOutput(json_schema='{"type": "integer"}')),
        constraint_of(pb.StructuredOutput(json_object=True)),
        constraint_of(pb.StructuredOutput(regex="[ab]+")),
        constraint_of(pb.StructuredOutput(grammar='start: "x" | "y"')),
        constraint_of(pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", "b"]))),
    ]
    assert [c.kind for c in made] == list(ConstraintKind)
    for constraint in made:
        grammars.check(constraint)
    for bad in (
        pb.StructuredOutput(json_object=False),
        pb.StructuredOutput(regex=""),
        pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", ""])),
        pb.StructuredOutput(),
    ):
        with pytest.raises(InvalidRequest):
            constraint_of(bad)
    with pytest.raises(InvalidRequest, match="regex"):
        grammars.check(constraint_of(pb.StructuredOutput(regex="(a")))


def test_a_constrained_stream_moved_mid_answer_goes_on_token_identical(model_dir, tokenizer):
    """As after its decode worker died: a new engine gets the prompt plus the output so far
    (resume_tokens of it), rebuilds the grammar's state from those tokens, and the rest of the
    answer is what the undisturbed run produced (greedy, batch-invariant)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from shared.control.messages import GenerateTask, SamplingParams
    from shared.engine.sequence import Sequence
    from tests.unit.test_engine import make_engine, run_to_end

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id])
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    prompt = tokenizer.encode("A JSON record of a small city:")
    sampling = dataclasses.replace(SamplingParams(max_tokens=120), constraint=constraint)

    def run(ids: list[int], resume: int) -> list[int]:
        task = GenerateTask("s", ids, sampling, "reply", time.time(), resume_tokens=resume)
        mask = compiler.state(constraint, ids[len(ids) - resume :])
        seq = Sequence.from_task(task, None, {tokenizer.eos_token_id}, 4096, mask=mask)
        engine = make_engine(model, num_blocks=64)
        engine.add(seq)
        run_to_end(engine)
        return seq.output_ids

    whole = run(prompt, 0)
    cut = len(whole) // 2
    assert cut > 3 and run(prompt + whole[:cut], cut) == whole[cut:]
    jsonschema.validate(json.loads(tokenizer.decode(whole, skip_special_tokens=True)), SCHEMA)


class SlowCompiles:
    """A worker runtime whose constraints take 0.3 s to compile; "bad" ones cannot."""

    worker_id = "w"

    def __init__(self):
        self.threads: list[int] = []

    def mask_of(self, task):
        self.threads.append(threading.get_ident())
        time.sleep(0.3)
        if task.sampling.constraint.spec == "bad":
            raise BadConstraint("the regex cannot be used: bad")
        return "a state"


def _task(spec: str | None):
    constraint = None if spec is None else Constraint(ConstraintKind.REGEX, spec)
    return SimpleNamespace(sampling=SimpleNamespace(constraint=constraint))


async def test_a_worker_compiles_a_constraint_off_its_event_loop():
    """The loop goes on (heartbeats, streams) while a schema compiles; a bad one is refused."""
    runtime, ticks = SlowCompiles(), []

    async def tick():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.02)

    ticker = asyncio.create_task(tick())
    try:
        assert await constrained(runtime, _task("a+")) == ("a state", None)
        state, refusal = await constrained(runtime, _task("bad"))
    finally:
        ticker.cancel()
    assert state is None and refusal.code is Code.INVALID_ARGUMENT and "bad" in refusal.message
    assert threading.get_ident() not in runtime.threads and len(runtime.threads) == 2
    assert len(ticks) >= 10 and max(b - a for a, b in zip(ticks, ticks[1:])) < 0.2
    assert await constrained(runtime, _task(None)) == (None, None) and len(runtime.threads) == 2
