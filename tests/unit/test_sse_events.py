"""A stream's events from the template are byte for byte what the Formatter's dict dumps to."""

import pytest

from services.gateway.openai_format import Formatter, TokenText
from services.gateway.openai_request import parse
from services.gateway.sse_events import SseEvents, event
from shared.api import tandem_pb2 as pb

MODEL = "m"
TEXTS = [" hello", 'a "quoted" \\ back\nslash\t', "é ünïcode 漢字 🙂", "\u2028\x00\x1f", ""]


def _bodies():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    yield "chat", chat
    yield "chat", chat | {"stream_options": {"include_usage": True}}
    yield "chat", chat | {"n": 3}
    yield "chat", chat | {"logprobs": True}
    yield "completion", {"prompt": "x"}
    yield "completion", {"prompt": "x", "n": 2, "stream_options": {"include_usage": True}}
    yield "completion", {"prompt": "x", "echo": True}
    yield "completion", {"prompt": "x", "logprobs": 2}


def _response(index, text, finish=0):
    r = pb.GenerateResponse(index=index, text=text, token_ids=[42] * max(1, len(text) // 3))
    if finish:
        r.finish_reason = finish
        r.usage.prompt_tokens, r.usage.completion_tokens = 5, 2
    return r


@pytest.mark.parametrize(("kind", "body"), list(_bodies()), ids=str)
def test_every_event_is_the_formatters_chunk_dumped(kind, body, tokenizer):
    req = parse(kind, {"model": MODEL, "stream": True} | body, MODEL)
    text_of = TokenText(tokenizer)
    fast, slow = Formatter(req, "abc", text_of), Formatter(req, "abc", text_of)
    slow.created = fast.created
    events = SseEvents(fast)
    n = max(1, req.request.sampling.n)
    responses = [_response(i, t) for t in TEXTS for i in range(n)]
    responses += [_response(i, "end", pb.FINISH_REASON_LENGTH) for i in range(n)]
    templated = 0
    for response in responses:
        started = fast.started(response.index)
        got, want = events.of(response), event(slow.chunk(response))
        assert got == want, (response.index, response.text)
        plain = events.plain and started and response.text and not response.finish_reason
        templated += bool(plain)
    assert fast._offsets == slow._offsets  # the text offsets kept alike
    if not req.logprobs and req.echo is None:
        assert templated == n * (len(TEXTS) - 2)  # all but each choice's first and empty ones
    else:
        assert templated == 0
