"""The HTTP API's refusals with the official client: 401 without a valid key, 429 with
Retry-After past a client's limit, 503 with no scheduler. The same keys and limits as gRPC."""

import json
import threading

import grpc
import openai
import pytest

from tests.integration.helpers import chat_request, collect
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow
KEY = "test-key-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(processes, nats, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"clients": [{"name": "a", "key": KEY, "max_streams": 1}]}))
    stack = start_stack(
        processes,
        nats,
        "it-openai-keys",
        "colocated",
        extra_env={"TANDEM_API_KEYS_FILE": str(keys)},
        wait=False,
    )
    stack.api_key = KEY
    yield stack
    stack.stop()


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=key, max_retries=0)


def ask(stack, key: str, **kw):
    return client(stack, key).chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": "Write a very long story."}],
        **({"max_tokens": 4} | kw),
    )


def _wait_ready(stack) -> None:
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(stack.http_url + "/ready", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline and not stack.dead(), stack.dead()
            time.sleep(0.5)


def test_refusals(keyed):
    _wait_ready(keyed)
    for key in ("", "wrong-key-0123456789"):
        with pytest.raises(openai.AuthenticationError) as err:
            ask(keyed, key or "none")
        assert err.value.status_code == 401 and "API key" in err.value.message
    # the gRPC API holds the same key
    with pytest.raises(grpc.RpcError) as rpc:
        collect(keyed.stub(), chat_request("hi", 2))
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ask(keyed, KEY).choices[0].message.content

    # One stream open (the key's limit): a second request gets 429 with Retry-After.
    stream = ask(keyed, KEY, max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as err:
        ask(keyed, KEY)
    assert err.value.status_code == 429 and int(err.value.response.headers["retry-after"]) >= 1
    assert "streams open" in err.value.message
    closing = threading.Thread(target=stream.close)
    closing.start()
    closing.join(10)
    keyed.wait_idle(timeout=10)  # the stream closed: its request is cancelled, its KV freed

    # No scheduler: 503.
    for name, proc in keyed.group.children:
        if name == "it-openai-keys-scheduler":
            proc.terminate()
            proc.wait(15)
    with pytest.raises(openai.APIStatusError) as err:
        ask(keyed, KEY)
    assert err.value.status_code == 503 and "scheduler" in err.value.message
