"""Gateway request validation with the real tokenizer: every bad request is INVALID_ARGUMENT."""

import math

import pytest

from services.gateway.prompt_tokenizer import PromptTokenizer
from services.gateway.validation import (
    LIGHT_CHARS,
    InvalidRequest,
    Limits,
    bounded,
    light,
    message_tokens,
    validate,
)
from shared.api import tandem_pb2 as pb


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return PromptTokenizer(tokenizer)


LIMITS = Limits(
    max_model_len=8192, default_max_tokens=256, max_tokens_limit=4096, max_stop_strings=16
)


def request(
    prompt: str = "Hello there", messages=(), request_id: str = "", **sampling
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
        sampling=pb.SamplingParams(**sampling),
    )


@pytest.mark.parametrize(
    "bad",
    [
        request(prompt=""),  # no prompt, no messages
        request(prompt="hi", messages=[("user", "hi")]),  # both
        request(prompt="", messages=[("robot", "hi")]),  # unknown role
        request(max_tokens=0),  # explicitly 0
        request(max_tokens=4097),  # above the limit
        request(temperature=-0.1),
        request(temperature=math.nan),
        request(temperature=math.inf),
        request(temperature=1001.0),
        request(top_k=2**20 + 1),
        request(top_p=0.0),
        request(top_p=1.5),
        request(top_p=math.nan),
        request(stop=["s"] * 17),  # too many stop strings
        request(stop=[""]),
        request(stop=["x" * 257]),
        request(request_id="has space"),
        request(request_id="x" * 129),
        request(request_id="semi;colon"),
        request(request_id="tab\there"),
        request(logprobs=True, top_logprobs=21),  # OpenAI's limit is 20
        request(top_logprobs=2),  # alternatives without logprobs
        request(presence_penalty=2.5),
        request(frequency_penalty=-2.5),
        request(frequency_penalty=math.nan),
        request(repetition_penalty=0.0),  # set to 0: not "unset"
        request(repetition_penalty=-1.0),
        request(repetition_penalty=math.inf),
        request(logit_bias={5: 100.5}),
        request(logit_bias={5: math.nan}),
        request(logit_bias={i: 1.0 for i in range(1025)}),
        request(logit_bias={49152: 1.0}),  # SmolLM2's vocabulary is 49152 tokens
        request(max_tokens=4, min_tokens=5),
        request(min_tokens=257),  # above the default max_tokens
    ],
    ids=lambda r: str(r).replace("\n", " ")[:60],
)
def test_invalid_requests_are_rejected(bad, prompts):
    with pytest.raises(InvalidRequest):
        validate(bad, prompts, LIMITS)


def test_prompt_plus_max_tokens_must_fit_the_context(tokenizer, prompts):
    prompt = "word " * 500
    n = len(tokenizer(prompt)["input_ids"])
    limits = Limits(
        max_model_len=n + 10, default_max_tokens=256, max_tokens_limit=4096, max_stop_strings=16
    )
    assert (
        len(validate(request(prompt, max_tokens=10), prompts, limits).prompt_token_ids) == n
    )  # exactly full
    with pytest.raises(InvalidRequest, match="context"):
        validate(request(prompt, max_tokens=11), prompts, limits)
    with pytest.raises(InvalidRequest, match="context"):
        validate(request(prompt), prompts, limits)  # the default max_tokens counts too
    with pytest.raises(InvalidRequest, match="context"):
        validate(request("word " * 8192, max_tokens=1), prompts, LIMITS)


def test_a_prompt_over_the_prompt_limit_is_refused(tokenizer, prompts):
    prompt = "word " * 100
    n = len(tokenizer(prompt)["input_ids"])
    limits = Limits(
        max_model_len=8192,
        default_max_tokens=8,
        max_tokens_limit=4096,
        max_stop_strings=16,
        max_prompt_tokens=n,
    )
    # exactly at the limit
    assert len(validate(request(prompt), prompts, limits).prompt_token_ids) == n
    longer = prompt + "and more words"
    with pytest.raises(
        InvalidRequest,
        match=f"the prompt is {len(tokenizer(longer)['input_ids'])} tokens, over the limit of {n}",
    ):
        validate(request(longer), prompts, limits)


def test_raw_prompt_is_tokenized(tokenizer, prompts):
    valid = validate(request("The capital of France is"), prompts, LIMITS)
    assert valid.prompt_token_ids == tokenizer("The capital of France is")["input_ids"]


def test_chat_messages_render_the_chat_template(tokenizer, prompts):
    chat = [("system", "Be brief."), ("user", "Hi!"), ("assistant", "Hello."), ("user", "2+2?")]
    valid = validate(request(prompt="", messages=chat), prompts, LIMITS)
    expected = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in chat], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert valid.prompt_token_ids == list(expected)
    assert tokenizer.decode(valid.prompt_token_ids).endswith("<|im_start|>assistant\n")


def test_defaults_for_unset_fields(prompts):
    valid = validate(request(), prompts, LIMITS)
    s = valid.sampling
    assert (s.max_tokens, s.top_p, s.temperature, s.top_k, s.stop, s.ignore_eos) == (
        256,
        1.0,
        0.0,
        0,
        [],
        False,
    )
    assert 0 <= s.seed < 2**63
    seeds = {validate(request(), prompts, LIMITS).sampling.seed for _ in range(5)}
    assert len(seeds) > 1  # random, not a constant
    assert len(valid.request_id) == 32  # a generated uuid hex


def test_explicit_values_are_kept(prompts):
    valid = validate(
        request(
            request_id="req-1.a:b_c",
            max_tokens=4096 - 3,
            temperature=0.5,
            top_p=0.25,
            top_k=7,
            seed=12345,
            stop=["\n\n", "x" * 256],
            ignore_eos=True,
            logprobs=True,
            top_logprobs=20,
        ),
        prompts,
        LIMITS,
    )
    s = valid.sampling
    assert (s.logprobs, s.top_logprobs) == (True, 20)
    assert valid.request_id == "req-1.a:b_c"
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos) == (
        4093,
        0.5,
        0.25,
        7,
        12345,
        True,
    )
    assert s.stop == ["\n\n", "x" * 256]
    assert validate(request(seed=0), prompts, LIMITS).sampling.seed == 0
    assert validate(request(seed=2**63 - 1), prompts, LIMITS).sampling.seed == 2**63 - 1
    assert validate(request(top_p=1.0, stop=["s"] * 16), prompts, LIMITS).sampling.top_p == 1.0


@pytest.mark.parametrize(
    "sampling, message",
    [
        (dict(presence_penalty=3), "presence_penalty must be a number in [-2, 2]"),
        (dict(frequency_penalty=-3), "frequency_penalty must be a number in [-2, 2]"),
        (dict(repetition_penalty=0), "repetition_penalty must be a number in (0, 100]"),
        (dict(logit_bias={1: -101}), "logit_bias values must be numbers in [-100, 100]"),
        (dict(logit_bias={60000: 1}), "logit_bias token ids must be below the vocabulary size"),
        (dict(max_tokens=3, min_tokens=4), "min_tokens (4) must be at most max_tokens (3)"),
    ],
)
def test_bad_penalties_are_refused_by_name(prompts, sampling, message):
    with pytest.raises(InvalidRequest) as err:
        validate(request(**sampling), prompts, LIMITS)
    assert str(err.value).startswith(message)


def test_penalties_bias_and_min_tokens_become_sampling_params(prompts):
    asked = request(
        presence_penalty=-2.0,
        frequency_penalty=0.5,
        repetition_penalty=1.25,
        logit_bias={49151: 100.0, 7: -100.0, 0: 0.5},
        max_tokens=9,
        min_tokens=9,
    )
    s = validate(asked, prompts, LIMITS).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (-2, 0.5, 1.25)
    assert (s.bias_token_ids, s.bias_values) == ([0, 7, 49151], [0.5, -100.0, 100.0])
    assert s.min_tokens == 9 and s.shapes_logits()
    plain = validate(request(), prompts, LIMITS).sampling
    assert plain.repetition_penalty == 1.0 and not plain.shapes_logits()  # unset: 1, off


def test_request_id_with_trailing_newline_is_rejected(prompts):
    with pytest.raises(InvalidRequest):
        validate(request(request_id="abc\n"), prompts, LIMITS)


def test_seeds_above_63_bits_are_kept_not_folded(prompts):
    assert validate(request(seed=2**64 - 1), prompts, LIMITS).sampling.seed == 2**64 - 1


def test_the_most_a_valid_request_may_ask_passes_the_wire_checks(prompts):
    """What the gateway accepts, the scheduler and workers must accept: a GenerateTask at every
    edge the validation allows survives encode -> decode (its range checks) unchanged."""
    from shared.control.messages import GenerateTask
    from shared.control.wire import decode, encode

    edge = request(
        request_id="r" * 128,
        max_tokens=4096,
        temperature=1000.0,
        top_p=1e-30,
        top_k=2**20,
        seed=2**64 - 1,
        stop=["x" * 256] * 16,
        ignore_eos=True,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=100.0,
        logit_bias={i * 48: (-100.0 if i % 2 else 100.0) for i in range(1024)},
        min_tokens=4096,
    )
    edge.priority = -(2**31)
    valid = validate(edge, prompts, LIMITS)
    task = GenerateTask(
        attempt_id=valid.request_id + ".0123456789ab",
        prompt_token_ids=valid.prompt_token_ids,
        sampling=valid.sampling,
        reply_subject="tandem.c.gateway.g.tokens",
        arrival_time=1.0,
        priority=edge.priority,
    )
    assert decode(encode(task), GenerateTask) == task


class CountingTokenizer(PromptTokenizer):
    """The real one, counting how often it renders a chat."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.rendered = 0

    def chat_ids(self, messages, tools=None):
        self.rendered += 1
        return super().chat_ids(messages, tools)


def test_a_flood_of_empty_messages_is_refused_by_its_count_before_any_rendering(tokenizer):
    """36,000 empty messages are 0 characters of content: their template frames alone are more
    than the context, and that is known from their count, without rendering one."""
    frame = message_tokens(PromptTokenizer(tokenizer))
    assert frame >= 3  # SmolLM2's <|im_start|>user\n ... <|im_end|>\n
    limits = Limits(8192, 256, 4096, 16, message_tokens=frame)
    counting = CountingTokenizer(tokenizer)
    flood = request(prompt="", messages=[("user", "")] * 4000)
    with pytest.raises(InvalidRequest, match="4000 messages take at least"):
        validate(flood, counting, limits)
    too_many = request(prompt="", messages=[("user", "")] * 36_000)
    with pytest.raises(InvalidRequest, match="at most 4096 messages"):
        bounded(too_many, limits)
    assert counting.rendered == 0
    few = request(prompt="", messages=[("user", "hi")] * 8)
    assert validate(few, counting, limits).prompt_token_ids and counting.rendered == 1


@pytest.mark.parametrize("role", ["system", "user", "assistant"])
def test_a_request_of_the_cheapest_messages_that_fits_is_never_refused_by_their_count(
    tokenizer, role
):
    """The frame is a floor for every role: as many empty messages of one role as the template
    renders within the budget pass the count check (an average over roles would refuse some)."""
    prompts = PromptTokenizer(tokenizer)
    frame = message_tokens(prompts)
    for count in (8, 40, 200):
        messages = [("user", "hi"), ("assistant", "")] + [(role, "")] * count
        rendered = len(prompts.chat_ids([{"role": r, "content": c} for r, c in messages]))
        limits = Limits(rendered + 1, 1, 1, 16, message_tokens=frame)
        bounded(request(prompt="", messages=messages), limits)  # raises if refused


class FramedChat:
    """A template whose frames differ by role (user 6 tokens, assistant 2, system refused
    after the first turn): the floor must be the cheapest role's, not an average."""

    FRAME = {"user": 6, "assistant": 2}

    def chat_ids(self, messages):
        if any(m["role"] == "system" for m in messages[1:]):
            raise ValueError("system comes first")
        return [0] * sum(self.FRAME[m["role"]] + len(m["content"]) for m in messages)


def test_the_message_floor_is_the_cheapest_roles_frame():
    assert message_tokens(FramedChat()) == 2
    limits = Limits(100, 1, 1, 16, message_tokens=message_tokens(FramedChat()))
    bounded(request(prompt="", messages=[("assistant", "")] * 49), limits)  # 98 tokens: fits
    with pytest.raises(InvalidRequest):
        bounded(request(prompt="", messages=[("assistant", "")] * 51), limits)


def test_only_a_request_bounded_small_by_its_shape_is_light(tokenizer, prompts):
    """Light: validated on the event loop (cheaper there than a turn on the tokenizer thread);
    anything whose cost its shape does not bound goes to the thread."""
    chat = [("system", "Be brief."), ("user", "Tell me a short story about a robot.")]
    assert light(request(prompt="", messages=chat), prompts)
    assert light(request(prompt="x" * LIGHT_CHARS), prompts)
    assert not light(request(prompt="x" * (LIGHT_CHARS + 1)), prompts)
    assert not light(request(prompt="", messages=[("user", "")] * 36_000), prompts)
    assert not light(request(prompt="", messages=[("user", "hi")] * 5), prompts)
    auto = request(prompt="", messages=chat)
    auto.tool_choice.mode = pb.TOOL_CHOICE_AUTO  # as every chat over HTTP says: no tools, light
    assert light(auto, prompts)
    auto.tools.add(name="f", parameters="{}")
    assert not light(auto, prompts)
    called = request(prompt="", messages=chat)
    called.messages[0].tool_calls.add(name="f", arguments="{}")
    assert not light(called, prompts)
    structured = request(prompt="hi")
    structured.sampling.structured_output.json_schema = '{"type": "object"}'
    assert not light(structured, prompts)
    hugging_faces_path = PromptTokenizer(tokenizer)
    hugging_faces_path._backend = None  # a slow tokenizer, or one set to truncate or pad
    assert not light(request(prompt="hi"), hugging_faces_path)
