"""Tools rendered into the prompt: a template that renders tools itself (Qwen2.5's, Llama 3.1's:
their published chat templates, transcribed into chat_templates/: no hub is reachable here, and no
installed package ships them) gets them in Hugging Face's shape; SmolLM2's, which
cannot, gets the documented Hermes default in its system turn, written as Qwen2.5's template
writes it; and which format each template's calls are read in."""

import json
import logging
from pathlib import Path

import pytest

from services.gateway.prompt_tokenizer import PromptTokenizer
from services.gateway.tool_format import ToolFormat
from services.gateway.tool_render import chat_of, hermes_system
from services.gateway.validation import InvalidRequest, Limits, validate
from shared import model_store
from shared.api import tandem_pb2 as pb

TEMPLATES = Path(__file__).parent / "chat_templates"
LIMITS = Limits(max_model_len=8192, default_max_tokens=16, max_tokens_limit=64, max_stop_strings=4)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = pb.Tool(name="get_weather", description="Weather now", parameters=json.dumps(WEATHER))
TOOL_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather now", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": '
    '["city"]}}}'
)
CALL = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
TURNS = [
    pb.ChatMessage(role="user", content="Weather in Paris and Rome?"),
    pb.ChatMessage(role="assistant", content="Let me look.", tool_calls=[CALL]),
    pb.ChatMessage(role="tool", content="18C", tool_call_id="call_1"),
    pb.ChatMessage(role="tool", content="21C", tool_call_id="call_2"),
]


@pytest.fixture(scope="module")
def with_template(model_dir):
    """PromptTokenizer over SmolLM2's tokenizer with chat template `name` (None: its own)."""

    def make(name: str | None) -> PromptTokenizer:
        tokenizer = model_store.load_tokenizer(model_dir)
        if name is not None:
            tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
        return PromptTokenizer(tokenizer)

    return make


def rendered(prompts: PromptTokenizer, request: pb.GenerateRequest) -> str:
    chat, tools = chat_of(request, prompts.tool_format.native)
    return prompts.tokenizer.apply_chat_template(
        chat, tools=tools, add_generation_prompt=True, tokenize=False
    )


def test_each_template_is_read_for_its_tool_format(with_template):
    assert with_template(None).tool_format == ToolFormat(native=False, parser="hermes")
    assert with_template("qwen2_5").tool_format == ToolFormat(native=True, parser="hermes")
    assert with_template("llama3_1").tool_format == ToolFormat(native=True, parser="llama3_json")
    mistral = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}[TOOL_CALLS]"
    assert ToolFormat.of(mistral) == ToolFormat(True, "mistral")
    assert ToolFormat.of(None) == ToolFormat(False, "hermes")
    assert ToolFormat.of({"default": "x", "tool_use": "{{ tools }}<tool_call>"}).native
    assert ToolFormat.of("{{ messages }}", "llama3_json") == ToolFormat(False, "llama3_json")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolFormat.of(None, "pythonic")


def test_a_template_with_tools_in_no_known_format_falls_back_to_hermes_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.tools"):
        assert ToolFormat.of("{% for t in tools %}{{ t }}{% endfor %}").parser == "hermes"
    assert "--tool-call-parser" in caplog.text


def test_smollm2_gets_the_hermes_default_as_qwen25s_template_writes_it(with_template):
    """With a system message, the default's whole prompt is what Qwen2.5's own template makes
    of the same chat: the tools after the system text, the call as <tool_call> text after the
    content, the two answers in one user turn of <tool_response> blocks."""
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="system", content="Be brief."), *TURNS], tools=[TOOL]
    )
    smollm2 = rendered(with_template(None), request)
    assert smollm2 == rendered(with_template("qwen2_5"), request)
    assert "<|im_start|>system\nBe brief.\n\n# Tools\n" in smollm2
    assert "<tools>\n" + TOOL_JSON + "\n</tools>" in smollm2
    assert (
        '<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
    ) in smollm2
    assert (
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in smollm2


def test_without_a_system_message_the_default_is_one_of_its_own(with_template):
    request = pb.GenerateRequest(messages=TURNS[:1], tools=[TOOL])
    text = rendered(with_template(None), request)
    assert text.startswith("<|im_start|>system\n" + hermes_system([TOOL]) + "<|im_end|>\n")
    assert hermes_system([TOOL]).startswith("# Tools\n\nYou may call one or more functions")
    assert hermes_system([TOOL]).endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def test_llama31s_template_gets_the_tools_and_the_calls_in_hugging_faces_shape(with_template):
    request = pb.GenerateRequest(messages=TURNS[:3], tools=[TOOL])
    text = rendered(with_template("llama3_1"), request)
    assert "Environment: ipython\n" in text
    assert json.dumps(json.loads(TOOL_JSON), indent=4) in text  # in the first user turn
    assert (  # the arguments went as a dict: its template writes them with tojson
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
        '{"city": "Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"18C"'
    ) in text


def test_a_template_that_refuses_the_messages_is_an_invalid_request(with_template):
    """Llama 3.1's template takes one call per message."""
    two = pb.ChatMessage(role="assistant", tool_calls=[CALL, CALL])
    request = pb.GenerateRequest(messages=[TURNS[0], two], tools=[TOOL])
    with pytest.raises(InvalidRequest, match="only supports single tool-calls"):
        validate(request, with_template("llama3_1"), LIMITS)


def test_a_chat_without_tools_renders_as_before(with_template, tokenizer):
    prompts = with_template(None)
    messages = [pb.ChatMessage(role="system", content="Be brief."), TURNS[0]]
    ids = validate(pb.GenerateRequest(messages=messages), prompts, LIMITS).prompt_token_ids
    plain = [{"role": m.role, "content": m.content} for m in messages]
    assert ids == tokenizer.apply_chat_template(plain, add_generation_prompt=True)["input_ids"]
