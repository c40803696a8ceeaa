"""The OpenAI-compatible HTTP API, driven by the official `openai` package (sync and async,
streamed and not) against a real stack: the same answers as the gRPC API and Hugging Face, in
OpenAI's shapes, with OpenAI's errors."""

import asyncio
import http.client
import json
import time

import openai
import pytest

from shared.api import tandem_pb2 as pb
from tests.integration.helpers import (
    LOGPROB_TOLERANCE,
    chat_request,
    collect,
    hf_greedy,
    hf_logprobs,
    prompt_ids,
)

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


def client(stack, **options) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, **options
    )


def model_of(stack) -> str:
    return client(stack).models.list().data[0].id


def test_models_lists_the_model_served(disagg):
    models = client(disagg).models.list().data
    assert len(models) == 1 and models[0].id.startswith("SmolLM2-135M-Instruct")


def test_chat_equals_the_grpc_api_and_hugging_face(disagg, hf_model, tokenizer):
    answer = client(disagg).chat.completions.create(
        model=model_of(disagg),
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    grpc_request = chat_request(QUESTION, 24)
    _, ids, grpc_text = collect(disagg.stub(), grpc_request)
    assert ids == hf_greedy(hf_model, tokenizer, grpc_request)
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == grpc_text
    assert choice.finish_reason in ("stop", "length") and choice.index == 0
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.usage.completion_tokens == len(ids)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + len(ids)
    assert answer.usage.prompt_tokens_details.cached_tokens >= 0
    timing = answer.model_extra["timing"]  # our extension
    assert timing["path"] == "disaggregated" and timing["ttft_ms"] > 0


def test_a_streamed_chat_has_openais_chunks(disagg):
    kw = dict(
        model=model_of(disagg),
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": QUESTION},
        ],
        max_completion_tokens=20,
        temperature=0,
    )
    whole = client(disagg).chat.completions.create(**kw).choices[0].message.content
    chunks = list(
        client(disagg).chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    *tokens, finish, usage = chunks
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in tokens)
    assert finish.choices[0].finish_reason in ("stop", "length")
    assert usage.choices == [] and usage.usage.completion_tokens == len(tokens) + 1
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_text_parts_and_a_string_render_alike(disagg):
    ask = client(disagg).chat.completions.create
    kw = dict(model=model_of(disagg), max_tokens=8, temperature=0)
    parts = [{"type": "text", "text": QUESTION}]
    by_parts = ask(messages=[{"role": "user", "content": parts}], **kw)
    by_string = ask(messages=[{"role": "user", "content": QUESTION}], **kw)
    assert by_parts.choices[0].message.content == by_string.choices[0].message.content


def test_completions_of_text_and_of_token_ids(disagg, tokenizer):
    prompt = "The three primary colors are"
    kw = dict(model=model_of(disagg), max_tokens=16, temperature=0)
    _, ids, grpc_text = collect(
        disagg.stub(),
        pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=16)),
    )
    by_text = client(disagg).completions.create(prompt=prompt, **kw)
    assert by_text.choices[0].text == grpc_text and by_text.object == "text_completion"
    by_ids = client(disagg).completions.create(prompt=tokenizer(prompt)["input_ids"], **kw)
    assert by_ids.choices[0].text == grpc_text
    streamed = client(disagg).completions.create(prompt=prompt, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed) == grpc_text


def test_the_async_client_streams(disagg):
    async def stream() -> str:
        async with openai.AsyncOpenAI(
            base_url=disagg.http_url + "/v1", api_key="unused", max_retries=0
        ) as aclient:
            chunks = await aclient.chat.completions.create(
                model=model_of(disagg),
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=12,
                temperature=0,
                stream=True,
            )
            return "".join([c.choices[0].delta.content or "" async for c in chunks])

    assert asyncio.run(stream()) == collect(disagg.stub(), chat_request(QUESTION, 12))[2]


def test_seed_stop_and_ignore_eos(disagg):
    ask = client(disagg).chat.completions.create
    kw = dict(
        model=model_of(disagg),
        messages=[{"role": "user", "content": "Invent a name for a cat."}],
        max_tokens=24,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    first = ask(**kw).choices[0]
    assert ask(**kw).choices[0].message.content == first.message.content
    assert first.finish_reason == "length"
    stop = first.message.content[5:8]
    cut = ask(**kw | {"stop": [stop, "\n\n\n"]}).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == first.message.content[:5]


def test_chat_logprobs_are_hugging_faces(disagg, hf_model, tokenizer):
    answer = client(disagg).chat.completions.create(
        model=model_of(disagg),
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    _, ids, _ = collect(disagg.stub(), chat_request(QUESTION, 10))
    reference = hf_logprobs(hf_model, prompt_ids(tokenizer, chat_request(QUESTION, 10)), ids)
    content = answer.choices[0].logprobs.content
    assert len(content) == len(ids)
    assert b"".join(bytes(e.bytes) for e in content).decode() == tokenizer.decode(ids)
    for row, token, entry in zip(reference, ids, content):
        assert abs(entry.logprob - float(row[token])) <= LOGPROB_TOLERANCE
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token


def test_frequency_penalty_and_logit_bias_as_the_grpc_api_takes_them(disagg, tokenizer):
    """OpenAI's logit_bias (string keys) and frequency_penalty, and vLLM's min_tokens and
    repetition_penalty (extra_body), through the official client: the gRPC API's answer."""
    kw = dict(repetition_penalty=1.2, frequency_penalty=0.8, presence_penalty=0.1, min_tokens=8)
    grpc_request = chat_request(QUESTION, 16, **kw)
    banned = collect(disagg.stub(), chat_request(QUESTION, 16))[1][0]  # the plain first token
    grpc_request.sampling.logit_bias[banned] = -100.0
    _, ids, text = collect(disagg.stub(), grpc_request)
    answer = client(disagg).chat.completions.create(
        model=model_of(disagg),
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
        frequency_penalty=0.8,
        presence_penalty=0.1,
        logit_bias={str(banned): -100},
        extra_body={"repetition_penalty": 1.2, "min_tokens": 8},
    )
    assert answer.choices[0].message.content == text and ids[0] != banned
    assert answer.usage.completion_tokens == len(ids) >= 8


def test_completion_logprobs_in_the_legacy_shape(disagg):
    answer = client(disagg).completions.create(
        model=model_of(disagg), prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2
    )
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == answer.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(
        len(top) <= 2 and max(top.values()) >= v
        for top, v in zip(lp.top_logprobs, lp.token_logprobs)
    )


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"temperature": -1}, "temperature"),
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_what_we_cannot_honour_is_a_400_that_names_it(disagg, extra, named):
    with pytest.raises(openai.BadRequestError) as err:
        client(disagg).chat.completions.create(
            model=model_of(disagg),
            messages=[{"role": "user", "content": "hi"}],
            **({"max_tokens": 4} | extra if "max_tokens" not in extra else extra),
        )
    assert err.value.status_code == 400 and named in err.value.message
    assert err.value.body["type"] == "invalid_request_error"


def test_images_are_refused_by_name(disagg):
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client(disagg).chat.completions.create(
            model=model_of(disagg), messages=[{"role": "user", "content": parts}], max_tokens=4
        )


def test_unknown_fields_are_ignored_and_an_unknown_model_is_404(disagg):
    answer = client(disagg).chat.completions.create(
        model=model_of(disagg),
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"some_future_field": {"x": 1}},
    )
    assert answer.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        client(disagg).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_a_deadline_is_a_504_and_frees_the_kv(disagg):
    disagg.wait_idle()
    with pytest.raises(openai.APIStatusError) as err:
        client(disagg).chat.completions.create(
            model=model_of(disagg),
            messages=[{"role": "user", "content": "Write a very long story."}],
            max_tokens=2000,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Timeout": "2"},
        )
    assert err.value.status_code == 504 and err.value.body["type"] == "timeout_error"
    disagg.wait_idle(timeout=10)


def test_a_client_that_goes_away_mid_stream_frees_the_kv(disagg):
    disagg.wait_idle()
    body = {
        "model": model_of(disagg),
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", disagg.http_port, timeout=60)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    events = [response.readline() for _ in range(6)]  # three events: a line and a blank each
    assert events[0].startswith(b"data: {")
    deadline = time.monotonic() + 5
    while not any(w.running for w in disagg.status().workers if w.role == "decode"):
        assert time.monotonic() < deadline, "the decode worker never reported the stream"
        time.sleep(0.1)
    conn.sock.close()  # gone, without a word
    conn.close()
    disagg.wait_idle(timeout=10)


def test_health_and_readiness(disagg):
    import urllib.request

    for path in ("/health", "/ready"):
        with urllib.request.urlopen(disagg.http_url + path, timeout=5) as reply:
            assert reply.status == 200
