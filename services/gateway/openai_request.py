"""OpenAI's request bodies (/v1/chat/completions, /v1/completions) as Tandem GenerateRequests.

The body becomes the same GenerateRequest a gRPC client sends, so both APIs share one path:
validation, limits, keys, placement. Fields outside OpenAI's API that peers (vLLM, SGLang) also
take are extensions here: top_k, ignore_eos, priority, repetition_penalty, min_tokens (the
sampling fields: openai_sampling.py). Unknown fields are ignored, as the peers do; fields whose
meaning we cannot honour (images, audio, best_of, suffix) are refused with a 400 that names them,
never silently dropped. A chat's tools (openai_tools.py) go with it. With n > 1 the choices' seeds are the
request's seed + their index. A completion may hold several prompts (as lm-eval sends them): each
becomes a request of its own, its choices numbered after the previous prompt's. `echo` starts
each choice with its prompt; with `logprobs`, each prompt token's log-probability too (computed
where the prompt is: SamplingParams.prompt_logprobs), and with max_tokens 0, nothing else.
"""

from dataclasses import dataclass, field
from typing import Any

from services.gateway.body_fields import BadRequest, fits, flag, integer
from services.gateway.chat_messages import messages_into
from services.gateway.openai_sampling import sampling_message
from services.gateway.openai_tools import tools_into
from services.gateway.sampling_defaults import OPENAI, SamplingDefaults
from services.gateway.validation import Limits
from shared.api import tandem_pb2 as pb
from shared.control import rules

# fields we cannot honour, with the value that means "not used" (None: any value is refused)
UNSUPPORTED = {
    "functions": None,  # the deprecated form of tools
    "function_call": "none",
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "best_of": 1,
    "suffix": None,
}
MODALITIES = ["text"]
MAX_COMPLETION_LOGPROBS = 20  # OpenAI allows 5; top_logprobs (chat) allows 20, as here
MAX_PROMPTS = 256  # prompts of one completion request (lm-eval batches several)


@dataclass
class OpenAIRequest:
    kind: str  # "chat" or "completion"
    request: pb.GenerateRequest
    model: str
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool = False
    top_logprobs: int = 0
    # completions: the prompts after the first, each a request of its own (choices i * n + j)
    more: list[pb.GenerateRequest] = field(default_factory=list)
    # completions' echo: each choice's text (and logprobs) starts with its prompt, as given
    echo: list[str | list[int]] | None = None
    echo_only: bool = False  # max_tokens 0: the prompt alone is answered (one token is computed)

    @property
    def requests(self) -> list[pb.GenerateRequest]:
        return [self.request, *self.more]


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
    echo, prompts = None, []
    if kind == "chat":
        messages_into(request, body.get("messages"), limits)
        tools_into(request, body)
        logprobs, top = _chat_logprobs(body)
    else:
        prompts = _prompts(body.get("prompt"), limits)
        top = integer(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS)
        logprobs = body.get("logprobs") is not None
        echo = prompts if flag(body, "echo") else None
        request.sampling.prompt_logprobs = echo is not None and logprobs
    echo_only = _echo_only(request.sampling, echo is not None)
    request.sampling.logprobs, request.sampling.top_logprobs = logprobs, top
    request.priority = integer(body, "priority", 0, -(1 << 31), (1 << 31) - 1)
    request.sampling.n = integer(body, "n", 1, 1, rules.MAX_N)
    requests = [_with_prompt(request, prompt) for prompt in prompts] or [request]
    return OpenAIRequest(
        kind,
        requests[0],
        model,
        stream=flag(body, "stream"),
        include_usage=_include_usage(body),
        logprobs=logprobs,
        top_logprobs=top,
        more=requests[1:],
        echo=echo,
        echo_only=echo_only,
    )


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return bool(options.get("include_usage"))


def _chat_logprobs(body: dict) -> tuple[bool, int]:
    logprobs, top = flag(body, "logprobs"), integer(body, "top_logprobs", 0, 0, 20)
    if top and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return logprobs, top


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


def _prompts(prompt: Any, limits: Limits | None) -> list[str | list[int]]:
    """The prompts of a completion: a string, token ids (a list of ints), or a list of either
    (at most MAX_PROMPTS), each checked by its size before any is copied."""
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if several else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
    for each in prompts:
        if isinstance(each, str):
            if limits is not None:
                fits(0, len(each), limits, "prompt")
        elif not (
            isinstance(each, list)
            and each
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in each)
        ):
            raise BadRequest(
                "prompt must be a string, a list of token ids, or a list of either", "prompt"
            )
    return prompts


def _with_prompt(request: pb.GenerateRequest, prompt: str | list[int]) -> pb.GenerateRequest:
    made = pb.GenerateRequest()
    made.CopyFrom(request)
    if isinstance(prompt, str):
        made.prompt = prompt
    else:
        made.prompt_token_ids.extend(prompt)
    return made


def _echo_only(sampling: pb.SamplingParams, echo: bool) -> bool:
    """max_tokens 0 asks for the prompt alone, which only echo answers: the cluster computes one
    token (a request generates at least one), and the answer leaves it out."""
    if not sampling.HasField("max_tokens") or sampling.max_tokens > 0:
        return False
    if not echo:
        raise BadRequest("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    sampling.max_tokens = 1
    return True
