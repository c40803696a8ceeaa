"""OpenAI's request bodies (/v1/chat/completions, /v1/completions) as Tandem GenerateRequests.

The body becomes the same GenerateRequest a gRPC client sends, so both APIs share one path:
validation, limits, keys, placement. Fields outside OpenAI's API that peers (vLLM, SGLang) also
take are extensions here: top_k, ignore_eos, priority, repetition_penalty, min_tokens. Unknown
fields are ignored, as the peers do; fields whose meaning we cannot honour (tools, response
formats, images) are refused with a 400 that names them, never silently dropped. With n > 1 the
choices' seeds are the request's seed + their index.
"""

from dataclasses import dataclass
from typing import Any

from services.gateway.openai_fields import BadRequest, flag, integer
from services.gateway.openai_sampling import sampling_message
from services.gateway.sampling_defaults import OPENAI, SamplingDefaults
from services.gateway.validation import InvalidRequest, Limits, refuse_oversized
from shared.api import tandem_pb2 as pb
from shared.control import rules

# fields we cannot honour, with the value that means "not used" (None: any value is refused)
UNSUPPORTED = {
    "tools": None,
    "tool_choice": "none",
    "functions": None,
    "function_call": "none",
    "response_format": {"type": "text"},
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "best_of": 1,
    "echo": False,
    "suffix": None,
}
MODALITIES = ["text"]
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_COMPLETION_LOGPROBS = 20  # OpenAI allows 5; top_logprobs (chat) allows 20, as here


@dataclass
class OpenAIRequest:
    kind: str  # "chat" or "completion"
    request: pb.GenerateRequest
    model: str
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool = False
    top_logprobs: int = 0


def parse(
    kind: str,
    body: Any,
    served_model: str,
    defaults: SamplingDefaults = OPENAI,
    limits: Limits | None = None,
) -> OpenAIRequest:
    """The request in `body` (decoded JSON) of `kind` ("chat" or "completion"); `defaults` for
    the sampling fields it leaves out (the model's generation config); `limits`: a prompt that
    cannot fit them is refused by its size before any of it is copied."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _refuse_unsupported(body)
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    request = pb.GenerateRequest(sampling=sampling_message(body, defaults))
    if kind == "chat":
        _messages_into(request, body.get("messages"), limits)
        logprobs = flag(body, "logprobs")
        top = integer(body, "top_logprobs", 0, 0, 20)
        if top and not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        _prompt_into(request, body.get("prompt"), limits)
        given = body.get("logprobs")
        top = integer(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS)
        logprobs = given is not None
    request.sampling.logprobs, request.sampling.top_logprobs = logprobs, top
    request.priority = integer(body, "priority", 0, -(1 << 31), (1 << 31) - 1)
    request.sampling.n = integer(body, "n", 1, 1, rules.MAX_N)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return OpenAIRequest(
        kind,
        request,
        model,
        stream=flag(body, "stream"),
        include_usage=bool(options.get("include_usage")),
        logprobs=logprobs,
        top_logprobs=top,
    )


def _refuse_unsupported(body: dict) -> None:
    found = [
        name
        for name, unused in UNSUPPORTED.items()
        if body.get(name) is not None and body[name] != unused
    ]
    if body.get("modalities") not in (None, MODALITIES):
        found.append("modalities")
    if found:
        raise BadRequest(
            f"not supported by this server: {', '.join(found)} (leave them out)", found[0]
        )


def _messages_into(request: pb.GenerateRequest, messages: Any, limits: Limits | None) -> None:
    """The messages, counted and their text measured before any is copied (a 1 MiB body holds
    tens of thousands, or a million characters)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    if len(messages) > rules.MAX_MESSAGES:
        raise BadRequest(f"at most {rules.MAX_MESSAGES} messages", "messages")
    parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and _parts(m))
    if parts > rules.MAX_CONTENT_PARTS:
        raise BadRequest(f"at most {rules.MAX_CONTENT_PARTS} content parts in all", "messages")
    if limits is not None:
        _fits(len(messages), sum(_chars(m) for m in messages), limits, "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", where)
        role = CHAT_ROLES.get(m.get("role"))
        if role is None:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}",
                f"{where}.role",
            )
        if m.get("tool_calls") or m.get("function_call"):
            raise BadRequest(f"{where}: tool calls are not supported", f"{where}.tool_calls")
        request.messages.add(role=role, content=_content(m.get("content"), where))


def _parts(message: dict) -> bool:
    return isinstance(message.get("content"), list)


def _chars(message: Any) -> int:
    """The characters of a message's text (what is not text is refused later, by name)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(p["text"])
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return 0


def _fits(messages: int, chars: int, limits: Limits, param: str) -> None:
    try:
        refuse_oversized(messages, chars, limits)
    except InvalidRequest as err:
        raise BadRequest(str(err), param) from None


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (other parts are refused by name)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of parts", where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(
                f"{where}.content: only text parts are supported, got {kind or part!r}",
                f"{where}.content",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt_into(request: pb.GenerateRequest, prompt: Any, limits: Limits | None) -> None:
    """A string, or token ids (a list of ints); a list of several prompts is refused."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and limits is not None:
        _fits(0, len(prompt), limits, "prompt")
    if isinstance(prompt, str):
        request.prompt = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        request.prompt_token_ids.extend(prompt)
    else:
        raise BadRequest(
            "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
        )
