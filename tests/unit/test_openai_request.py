"""OpenAI request bodies as GenerateRequests, and GenerateResponses in OpenAI's shapes."""

import asyncio
import json

import grpc
import pytest

from services.gateway.http_body import BodyTurns, TooManyObjects, decode_json
from services.gateway.http_context import HttpCallContext, http_error, parse_timeout
from services.gateway.openai_format import ChoiceLog, Formatter, TokenText
from services.gateway.openai_request import BadRequest, parse
from services.gateway.validation import Limits
from shared.api import tandem_pb2 as pb

MODEL = "m"


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | fields


def test_a_chat_body_becomes_a_generate_request():
    req = parse(
        "chat",
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            max_completion_tokens=7,
            max_tokens=99,
            temperature=0.5,
            top_p=0.9,
            top_k=-1,
            seed=-1,
            stop="x",
            logprobs=True,
            top_logprobs=4,
            ignore_eos=True,
            priority=3,
            user="u",
            stream=True,
            stream_options={"include_usage": True},
        ),
        MODEL,
    )
    r, s = req.request, req.request.sampling
    assert [(m.role, m.content) for m in r.messages] == [
        ("system", "be brief"),
        ("user", "a\nb"),
        ("assistant", ""),
    ]
    assert (s.max_tokens, s.temperature, s.top_k, s.stop, s.ignore_eos) == (7, 0.5, 0, ["x"], True)
    assert s.top_p == pytest.approx(0.9) and s.seed == 2**64 - 1
    assert (s.logprobs, s.top_logprobs, r.priority) == (True, 4, 3)
    assert req.stream and req.include_usage and req.logprobs and req.top_logprobs == 4


def test_openais_defaults():
    req = parse("chat", chat(), MODEL)
    s = req.request.sampling
    assert s.temperature == 1.0 and s.top_p == 1.0 and not s.HasField("max_tokens")
    assert not s.HasField("seed") and not req.stream and not req.logprobs


def test_completion_prompts_and_logprobs():
    by_ids = parse("completion", {"prompt": [[1, 2, 3]], "logprobs": 0}, MODEL)
    assert list(by_ids.request.prompt_token_ids) == [1, 2, 3]
    assert by_ids.logprobs and by_ids.top_logprobs == 0
    by_text = parse("completion", {"prompt": "hello", "logprobs": 2}, MODEL)
    assert by_text.request.prompt == "hello" and by_text.request.sampling.top_logprobs == 2
    assert not parse("completion", {"prompt": "x"}, MODEL).logprobs


@pytest.mark.parametrize(
    "kind, body, named",
    [
        ("chat", chat(tools=[{}]), "tools[0]"),
        ("chat", chat(tool_choice="required"), "tool_choice"),
        ("chat", chat(functions=[{"name": "f"}]), "functions"),
        ("chat", chat(response_format={"type": "json_schema"}), "response_format"),
        ("chat", chat(logit_bias={"1": 101}), "logit_bias"),
        ("chat", chat(logit_bias={"1": "up"}), "logit_bias"),
        ("chat", chat(logit_bias={"1": None}), "logit_bias"),
        ("chat", chat(logit_bias={"-1": 5}), "logit_bias"),
        ("chat", chat(logit_bias={"x": 5}), "logit_bias"),
        ("chat", chat(logit_bias={str(2**31): 5}), "logit_bias"),
        ("chat", chat(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
        ("chat", chat(logit_bias=[[1, 5]]), "logit_bias"),
        ("chat", chat(frequency_penalty=2.5), "frequency_penalty"),
        ("chat", chat(frequency_penalty="high"), "frequency_penalty"),
        ("chat", chat(presence_penalty=-2.01), "presence_penalty"),
        ("chat", chat(repetition_penalty=0), "repetition_penalty"),
        ("chat", chat(repetition_penalty=-1.1), "repetition_penalty"),
        ("chat", chat(repetition_penalty=True), "repetition_penalty"),
        ("chat", chat(min_tokens=-1), "min_tokens"),
        ("chat", chat(min_tokens=9, max_tokens=8), "min_tokens"),
        ("completion", {"prompt": "x", "min_tokens": 1.5}, "min_tokens"),
        ("chat", chat(modalities=["text", "audio"]), "modalities"),
        ("chat", chat(n=0), "n"),
        ("chat", chat(n=65), "n"),
        ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("completion", {"prompt": ["a"] * 257}, "prompt"),
        ("completion", {"prompt": ["a", []]}, "prompt"),
        ("completion", {"prompt": "x", "best_of": 3}, "best_of"),
        ("completion", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("chat", chat(messages=[]), "messages"),
        ("chat", chat(messages=[{"role": "user"}] * 4097), "messages"),  # counted before read
        (
            "chat",
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": ""}] * 2049}] * 2),
            "messages",
        ),
        ("chat", chat(messages=[{"role": "function", "content": "x"}]), "messages[0].role"),
        ("chat", chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        (
            "chat",
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content",
        ),
        ("chat", chat(temperature="hot"), "temperature"),
        ("chat", chat(max_tokens=0), "max_tokens"),
        ("chat", chat(top_logprobs=2), "top_logprobs"),
        ("chat", chat(top_logprobs=21, logprobs=True), "top_logprobs"),
        ("chat", chat(stream=1), "stream"),
        ("chat", chat(stop=[1]), "stop"),
        ("chat", chat(model=5), "model"),
        ("completion", {"prompt": [1, -2]}, "prompt"),
        ("completion", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("completion", {}, "prompt"),
    ],
)
def test_refusals_name_the_field(kind, body, named):
    with pytest.raises(BadRequest) as err:
        parse(kind, body, MODEL)
    assert err.value.param == named


def test_penalties_logit_bias_and_min_tokens_are_taken():
    """OpenAI's presence_penalty, frequency_penalty and logit_bias (string keys of token ids), and
    vLLM's repetition_penalty and min_tokens, as the gRPC API's fields."""
    body = chat(
        presence_penalty=-2,
        frequency_penalty=0.5,
        repetition_penalty=1.25,
        logit_bias={"15": -100, "7": 100, "0": 2.5},
        min_tokens=4,
        max_tokens=4,
    )
    s = parse("chat", body, MODEL).request.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (-2, 0.5, 1.25)
    assert dict(s.logit_bias) == {15: -100.0, 7: 100.0, 0: 2.5} and s.min_tokens == 4
    plain = parse("completion", {"prompt": "x", "logit_bias": None}, MODEL).request.sampling
    assert not plain.HasField("repetition_penalty") and not plain.logit_bias
    assert (plain.presence_penalty, plain.frequency_penalty, plain.min_tokens) == (0, 0, 0)


def test_fields_left_at_their_unused_values_are_accepted():
    parse(
        "chat",
        chat(
            tools=None,
            tool_choice="none",
            response_format={"type": "text"},
            n=1,
            presence_penalty=0,
            logit_bias={},
        ),
        MODEL,
    )
    parse("completion", {"prompt": "x", "echo": False, "best_of": 1}, MODEL)


@pytest.mark.parametrize(
    "code, status, retry_after",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, None),
        (grpc.StatusCode.UNAUTHENTICATED, 401, None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "3"),
        (grpc.StatusCode.UNAVAILABLE, 503, None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
        (grpc.StatusCode.INTERNAL, 500, None),
    ],
)
def test_grpc_statuses_as_openai_errors(code, status, retry_after):
    error = http_error(code, "why", retry_after_ms=2500)
    assert error.status == status and error.body["error"]["message"] == "why"
    assert error.headers.get("Retry-After") == retry_after


async def test_the_call_context_answers_as_grpcs_would():
    context = HttpCallContext("Bearer k", ("::1", 5), "client-a", timeout_s=30)
    assert context.invocation_metadata() == (("authorization", "Bearer k"),)
    assert context.peer() == "ipv6:[::1]:5"
    assert context.auth_context() == {"x509_common_name": [b"client-a"]}
    assert 29 < context.time_remaining() <= 30
    context.set_trailing_metadata((("retry-after-ms", "700"),))
    with pytest.raises(Exception) as err:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert (err.value.code, err.value.retry_after_ms) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 700)
    assert HttpCallContext(None, ("10.0.0.1", 9)).peer() == "ipv4:10.0.0.1:9"
    assert HttpCallContext(None, None).time_remaining() is None


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "1e9"])
def test_a_malformed_timeout_header_is_refused(bad):
    with pytest.raises(ValueError):
        parse_timeout(bad)


def test_token_text_shows_bytes_of_partial_characters(tokenizer):
    text_of = TokenText(tokenizer)
    ids = tokenizer("naïve 🙂")["input_ids"]
    pieces = [text_of(i) for i in ids]
    assert b"".join(bytes(raw) for _, raw in pieces).decode() == "naïve 🙂"
    partial = [text for text, raw in pieces if text.startswith("bytes:")]
    assert all(len(p) > 6 for p in partial)


def _response(text, ids, finish=0, logprobs=()):
    r = pb.GenerateResponse(text=text, token_ids=ids, finish_reason=finish, logprobs=logprobs)
    if finish:
        r.usage.prompt_tokens, r.usage.completion_tokens = 5, 2
        r.timing.cached_tokens, r.timing.path = 3, "local"
    return r


def test_chunks_and_the_whole_answer_in_openais_shape(tokenizer):
    req = parse(
        "chat", chat(logprobs=True, top_logprobs=1, stream_options={"include_usage": True}), MODEL
    )
    f = Formatter(req, "abc", TokenText(tokenizer))
    lp = pb.TokenLogprob(token_id=42, logprob=-0.5, top=[pb.TopLogprob(token_id=42, logprob=-0.5)])
    first = f.chunk(_response("Hi", [42], logprobs=[lp]))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    last = f.chunk(_response("!", [43], finish=pb.FINISH_REASON_LENGTH))
    assert last["choices"][0]["delta"] == {"content": "!"}
    assert last["choices"][0]["finish_reason"] == "length" and last["timing"]["path"] == "local"
    usage = f.usage_chunk([_response("", [], finish=pb.FINISH_REASON_STOP)])
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    log = ChoiceLog()
    log.add(_response("Hi", [42]))
    log.add(_response("!", [43], finish=pb.FINISH_REASON_STOP))
    whole = f.response({0: log}, [_response("!", [43], finish=pb.FINISH_REASON_STOP)])
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert whole["usage"]["total_tokens"] == 7 and whole["id"] == "chatcmpl-abc"


def test_n_choices_are_counted_once_each_and_the_prompt_once(tokenizer):
    req = parse("completion", {"prompt": "x", "n": 2}, MODEL)
    assert req.request.sampling.n == 2
    f = Formatter(req, "abc", TokenText(tokenizer))
    logs, lasts = {}, []
    for index, text in ((1, "b"), (0, "a")):
        last = _response(text, [42], finish=pb.FINISH_REASON_LENGTH)
        last.index = index
        logs.setdefault(index, ChoiceLog()).add(last)
        lasts.append(last)
    whole = f.response(logs, lasts)
    assert [(c["index"], c["text"]) for c in whole["choices"]] == [(0, "a"), (1, "b")]
    assert whole["usage"]["prompt_tokens"] == 5 and whole["usage"]["completion_tokens"] == 4


LIMITS = Limits(
    max_model_len=100,
    default_max_tokens=8,
    max_tokens_limit=64,
    max_stop_strings=4,
    max_prompt_chars=1000,
    message_tokens=5,
)


def test_a_prompt_that_cannot_fit_is_refused_by_its_size_before_it_is_copied():
    """21 messages frame at least 105 tokens, over a budget of 100; 1001 characters are more than
    the context can hold: refused on the decoded body, with the field at fault."""
    many = [{"role": "user", "content": ""}] * 21
    with pytest.raises(BadRequest, match="21 messages take at least 105 tokens") as err:
        parse("chat", chat(messages=many), MODEL, limits=LIMITS)
    assert err.value.param == "messages"
    parts = [{"type": "text", "text": "x" * 501}] * 2
    with pytest.raises(BadRequest, match="1002 characters"):
        parse("chat", chat(messages=[{"role": "user", "content": parts}]), MODEL, limits=LIMITS)
    with pytest.raises(BadRequest, match="1001 characters") as err:
        parse("completion", {"model": MODEL, "prompt": "x" * 1001}, MODEL, limits=LIMITS)
    assert err.value.param == "prompt"
    fits = parse("chat", chat(messages=many[:20]), MODEL, limits=LIMITS)
    assert len(fits.request.messages) == 20


def test_decoding_a_body_stops_at_more_objects_than_any_request_holds():
    flood = json.dumps({"messages": [{"role": "user", "content": ""}] * 36_000}).encode()
    with pytest.raises(TooManyObjects):  # not a JSON error: it stopped long before the end
        decode_json(flood[:-1] + b"!")
    most = {"messages": [{"role": "user", "content": [{"type": "text", "text": "{}"}]}] * 4096}
    assert decode_json(json.dumps(most).encode()) == most  # the largest request the API takes
    with pytest.raises(ValueError):
        decode_json(b"{not json")


async def test_each_clients_bodies_are_read_one_at_a_time_and_others_pass_them():
    turns, order = BodyTurns(lambda client: False), []
    gate = asyncio.Event()

    async def read(client: str, n: int) -> None:
        async with turns.turn(client):
            order.append(f"{client}{n} in")
            if client == "A":
                await gate.wait()
            order.append(f"{client}{n} out")

    flood = [asyncio.ensure_future(read("A", n)) for n in range(3)]
    await asyncio.sleep(0)
    await read("B", 0)  # not behind A's three
    assert order == ["A0 in", "B0 in", "B0 out"]
    gate.set()
    await asyncio.gather(*flood)
    assert order[3:] == ["A0 out", "A1 in", "A1 out", "A2 in", "A2 out"]
    assert turns.clients == 0  # nothing kept for clients that went


async def test_while_others_are_served_a_clients_next_body_waits_as_long_as_its_last_took():
    waits, others = [], {"A": True, "B": False}

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    turns = BodyTurns(lambda client: others[client], sleep)
    for client in "AB":
        async with turns.turn(client) as bill:
            bill.seconds = 0.004  # as Bill.timing() adds a decode's time
    assert waits == [0.004]  # A's, beside B; B alone waits for nothing


def test_several_prompts_are_requests_of_their_own_and_echo_asks_for_prompt_logprobs():
    req = parse(
        "completion",
        {"prompt": [[1, 2, 3], "text"], "echo": True, "logprobs": 1, "max_tokens": 0, "n": 2},
        MODEL,
    )
    first, second = req.requests
    assert list(first.prompt_token_ids) == [1, 2, 3] and second.prompt == "text"
    for each in req.requests:
        s = each.sampling
        assert (s.prompt_logprobs, s.logprobs, s.top_logprobs, s.max_tokens, s.n) == (
            True,
            True,
            1,
            1,  # max_tokens 0: one token computed, left out of the answer
            2,
        )
    assert req.echo == [[1, 2, 3], "text"] and req.echo_only
    plain = parse("completion", {"prompt": "x", "echo": True}, MODEL)
    assert plain.echo == ["x"] and not plain.request.sampling.prompt_logprobs
    assert not parse(
        "completion", {"prompt": "x", "logprobs": 1}, MODEL
    ).request.sampling.prompt_logprobs


def _echoed(prompt_ids, text, ids, logprob, finish=0):
    response = _response(text, ids, finish, [pb.TokenLogprob(token_id=ids[0], logprob=logprob)])
    response.prompt_token_ids.extend(prompt_ids)
    for token, value in zip(prompt_ids[1:], (-1.0, -2.0)):
        response.prompt_logprobs.append(
            pb.TokenLogprob(
                token_id=token, logprob=value, top=[pb.TopLogprob(token_id=7, logprob=-0.5)]
            )
        )
    return response


def test_an_echo_starts_each_choice_with_its_prompt_and_its_prompts_logprobs(tokenizer):
    text_of = TokenText(tokenizer)
    prompt = tokenizer.encode("The cat sat")[:3]
    body = {"prompt": [prompt], "echo": True, "logprobs": 1}
    for only in (False, True):
        req = parse("completion", body | {"max_tokens": 0 if only else 4}, MODEL)
        f = Formatter(req, "abc", text_of)
        log = f.choice_log()
        last = _echoed(prompt, " on", [42], -0.25, finish=pb.FINISH_REASON_LENGTH)
        log.add(last)
        choice = f.response({0: log}, [last])["choices"][0]
        words = tokenizer.decode(prompt)
        lp = choice["logprobs"]
        assert choice["text"] == (words if only else words + " on")
        assert lp["token_logprobs"] == [None, -1.0, -2.0] + ([] if only else [-0.25])
        assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {text_of(7)[0]: -0.5}
        assert lp["tokens"][:3] == [text_of(t)[0] for t in prompt]
        assert lp["text_offset"][1] == len(text_of(prompt[0])[0])
        assert f.response({0: log}, [last])["usage"]["completion_tokens"] == (0 if only else 2)
        streamed = Formatter(req, "abc", text_of).chunk(last)["choices"][0]
        assert (streamed["text"], streamed["logprobs"]) == (choice["text"], choice["logprobs"])


def test_the_usage_of_several_prompts_counts_each_prompt_once(tokenizer):
    req = parse("completion", {"prompt": ["a", "b"], "n": 2}, MODEL)
    f = Formatter(req, "abc", TokenText(tokenizer))
    lasts = []
    for index in range(4):
        last = _response("x", [42], finish=pb.FINISH_REASON_LENGTH)
        last.index = index
        lasts.append(last)
    assert f.response({}, lasts)["usage"]["prompt_tokens"] == 10  # two prompts of 5


def test_structured_outputs_asked_every_way_become_one_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
            "json_schema",
        ),
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
        ({"structured_outputs": {"json": schema}}, "json_schema"),
        ({"guided_grammar": 'start: "a"'}, "grammar"),
        ({"guided_choice": ["a", "b"]}, "choice"),
    ]
    for extra, kind in cases:
        s = parse("chat", chat(**extra), MODEL).request.sampling
        assert s.structured_output.WhichOneof("kind") == kind, extra
    s = parse("chat", chat(guided_json=json.dumps(schema)), MODEL).request.sampling
    assert json.loads(s.structured_output.json_schema) == schema
    completion = parse("completion", {"prompt": ["a", "b"], "guided_regex": "x"}, MODEL)
    assert all(r.sampling.structured_output.regex == "x" for r in completion.requests)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_a_structured_output_asked_wrongly_is_a_400_naming_it(extra, named):
    with pytest.raises(BadRequest) as err:
        parse("chat", chat(**extra), MODEL)
    assert err.value.param == named
