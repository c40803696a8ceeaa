"""Turns a GenerateRequest into token ids and SamplingParams, or a clear INVALID_ARGUMENT message.

What a request may cost is bounded before any tokenizer work (`bounded`, on the event loop, a
count and a sum): its messages are counted, each chat message adds at least the frame its
template wraps it in (`Limits.message_tokens`), and its characters cannot exceed what the context
holds. Rendering and tokenizing (`validate`) run on the tokenizer thread only. A request's tools
are checked, rendered and turned into a constraint by the tool_* modules (docs/api.md#tool-calls).
"""

import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass

import jinja2

from services.gateway.constraints import Grammars, constraint_of
from services.gateway.invalid import InvalidRequest
from services.gateway.prompt_tokenizer import PromptTokenizer
from services.gateway.tool_render import chat_of
from services.gateway.tool_request import ToolPlan, check_tools, plan_of, tool_chars
from services.gateway.tool_schema import tool_constraint
from shared.api import tandem_pb2 as pb
from shared.control import rules
from shared.control.messages import SamplingParams
from shared.values.constraint import Constraint

ROLES = ("system", "user", "assistant")  # each role's frame bounds a request's messages
CHAT_ROLES = (*ROLES, "tool")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_STOP_CHARS = 256


@dataclass
class Limits:
    max_model_len: int
    default_max_tokens: int
    max_tokens_limit: int
    max_stop_strings: int
    max_prompt_tokens: int = 0  # 0: any prompt that fits the context with its max_tokens
    # a prompt this many characters long cannot fit (no token covers more than the longest in
    # the vocabulary): refused by its size, before any tokenizer work. 0: no such check
    max_prompt_chars: int = 0
    # the fewest tokens one chat message adds (its template's frame around empty content): a
    # request of many messages is refused by their count, before rendering. 0: no such check
    message_tokens: int = 0


@dataclass
class ValidRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tokenized: tuple[float, float] = (0.0, 0.0)  # unix times the tokenizer's work began, ended
    tools: ToolPlan | None = None  # how its output becomes tool calls (None: it does not)


def max_prompt_chars(tokenizer, max_tokens: int) -> int:
    """Characters beyond which a prompt has more than `max_tokens` tokens, whatever they are: each
    token covers at most as many characters as its vocabulary entry is long."""
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=0)
    return (max_tokens + 1) * max(longest, 1)


def message_tokens(tokens: PromptTokenizer) -> int:
    """The fewest tokens one chat message adds, whatever its role: each role's empty message
    appended to a user/assistant turn, the smallest growth (a role the template refuses there is
    not counted; 0 when none renders: no such check then). An average over roles would refuse a
    request of the cheapest role that fits."""
    turn = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    grown = []
    for role in ROLES:
        try:
            grown.append(
                len(tokens.chat_ids([*turn, {"role": role, "content": ""}]))
                - len(tokens.chat_ids(turn))
            )
        except Exception:  # a template with rules of its own (roles, order): not this role
            continue
    return max(0, min(grown, default=0))


def request_id_of(request: pb.GenerateRequest) -> str:
    if not request.request_id:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(request.request_id):
        raise InvalidRequest("request_id must be 1-128 characters of letters, digits and . _ : -")
    return request.request_id


def sampling_of(request: pb.GenerateRequest, limits: Limits) -> SamplingParams:
    s = request.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else limits.default_max_tokens
    if max_tokens == 0:
        raise InvalidRequest("max_tokens must be at least 1")
    if max_tokens > limits.max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens {max_tokens} is above the limit of {limits.max_tokens_limit}"
        )
    if not math.isfinite(s.temperature) or not 0 <= s.temperature <= rules.MAX_TEMPERATURE:
        raise InvalidRequest(f"temperature must be a number in [0, {rules.MAX_TEMPERATURE:.0f}]")
    if s.top_k > rules.MAX_TOP_K:
        raise InvalidRequest(f"top_k must be at most {rules.MAX_TOP_K} (0 = off)")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):
        raise InvalidRequest("top_p must lie in (0, 1]")
    if len(s.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"at most {limits.max_stop_strings} stop strings")
    if any(not stop or len(stop) > MAX_STOP_CHARS for stop in s.stop):
        raise InvalidRequest(f"stop strings must be 1-{MAX_STOP_CHARS} characters")
    if s.top_logprobs > rules.MAX_TOP_LOGPROBS or (s.top_logprobs and not s.logprobs):
        raise InvalidRequest(
            f"top_logprobs must be at most {rules.MAX_TOP_LOGPROBS}, and needs logprobs set"
        )
    if s.n > rules.MAX_N:
        raise InvalidRequest(f"n must be at most {rules.MAX_N}")
    seed = s.seed if s.HasField("seed") else secrets.randbits(63)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(s.temperature),
        top_p=float(top_p),
        top_k=int(s.top_k),
        seed=seed,
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        top_logprobs=int(s.top_logprobs),
        n=max(1, int(s.n)),
        prompt_logprobs=s.prompt_logprobs,
        constraint=constraint_of(s.structured_output) if s.HasField("structured_output") else None,
        **penalties_of(s, max_tokens),
    )


def penalties_of(s: pb.SamplingParams, max_tokens: int) -> dict:
    """The penalty, logit bias and min_tokens fields of SamplingParams (their token ids are
    checked against the vocabulary by `validate`, which knows it)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not math.isfinite(value) or not -rules.MAX_PENALTY <= value <= rules.MAX_PENALTY:
            raise InvalidRequest(f"{name} must be a number in [-2, 2]")
    repetition = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    if not math.isfinite(repetition) or not 0 < repetition <= rules.MAX_REPETITION_PENALTY:
        raise InvalidRequest(
            f"repetition_penalty must be a number in (0, {rules.MAX_REPETITION_PENALTY:.0f}]"
        )
    if len(s.logit_bias) > rules.MAX_BIAS_TOKENS:
        raise InvalidRequest(f"logit_bias may name at most {rules.MAX_BIAS_TOKENS} tokens")
    bias = sorted(s.logit_bias.items())
    if not all(-rules.MAX_LOGIT_BIAS <= value <= rules.MAX_LOGIT_BIAS for _, value in bias):
        raise InvalidRequest("logit_bias values must be numbers in [-100, 100]")
    if s.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({s.min_tokens}) must be at most max_tokens ({max_tokens})"
        )
    return dict(
        presence_penalty=float(s.presence_penalty),
        frequency_penalty=float(s.frequency_penalty),
        repetition_penalty=float(repetition),
        bias_token_ids=[int(token) for token, _ in bias],
        bias_values=[float(value) for _, value in bias],
        min_tokens=int(s.min_tokens),
    )


def prompt_ids_of(request: pb.GenerateRequest, tokens: PromptTokenizer) -> list[int]:
    """Tokenizes the raw prompt, or renders the messages with the model's chat template."""
    if (bool(request.prompt) + bool(request.messages) + bool(request.prompt_token_ids)) > 1:
        raise InvalidRequest("give one of prompt, messages or prompt_token_ids")
    if request.prompt_token_ids:
        if max(request.prompt_token_ids) >= tokens.vocab_size:
            raise InvalidRequest(
                f"prompt_token_ids must be below the vocabulary size, {tokens.vocab_size}"
            )
        return list(request.prompt_token_ids)
    if request.messages:
        for m in request.messages:
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"unknown role {m.role!r}: use one of {', '.join(CHAT_ROLES)}")
        try:
            return tokens.chat_ids(*chat_of(request, tokens.tool_format.native))
        except jinja2.TemplateError as err:  # a template's raise_exception: messages it refuses
            message = f"the model's chat template refuses these messages: {err}"
            raise InvalidRequest(message) from None
    if not request.prompt:
        raise InvalidRequest("prompt is empty: give a prompt, messages or prompt_token_ids")
    ids = tokens.text_ids(request.prompt, special_tokens=True)
    if not ids:
        raise InvalidRequest("the prompt has no tokens")
    return ids


def bounded(request: pb.GenerateRequest, limits: Limits) -> None:
    """Refuses, before any tokenizer work, a request whose prompt cannot fit: too many messages,
    more messages than their frames leave room for, or more characters than the context holds."""
    if len(request.messages) > rules.MAX_MESSAGES:
        raise InvalidRequest(f"at most {rules.MAX_MESSAGES} messages")
    chars = len(request.prompt) + sum(len(m.content) for m in request.messages)
    chars += tool_chars(request)
    refuse_oversized(len(request.messages), chars, limits)


def refuse_oversized(messages: int, chars: int, limits: Limits) -> None:
    """InvalidRequest when `messages` chat messages (their frames) or `chars` characters of prompt
    cannot fit the prompt's budget, whatever they say: checked by the OpenAI API on the decoded
    body, before a message is copied, and again on every request before rendering."""
    budget = limits.max_prompt_tokens or limits.max_model_len
    framed = messages * limits.message_tokens
    if framed > budget:
        raise InvalidRequest(
            f"{messages} messages take at least {framed} tokens: more than the "
            f"{budget} a prompt may have"
        )
    if limits.max_prompt_chars and chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"the prompt is {chars} characters: more than the model's context of "
            f"{limits.max_model_len} tokens can hold"
        )


def _with_tools(request: pb.GenerateRequest, structured: Constraint | None) -> Constraint | None:
    """What the output must match: its structured output, or the calls' JSON a tool_choice of
    required or a named function asks for (tool_schema.py); not both."""
    check_tools(request)
    tools = tool_constraint(request)
    if tools is None:
        return structured
    if structured is not None:
        raise InvalidRequest(
            "tool_choice required or a named function constrains the output itself: "
            "it cannot go with a structured output"
        )
    return tools


# A request at most this big is checked on the event loop (light): its rendering and tokenizing
# cost at most ~0.5 ms (256 characters of emoji, the dearest text measured: ~1.7 us a character),
# less than handing it to the tokenizer thread and back costs a short one (~150 us of CPU).
LIGHT_CHARS = 256
LIGHT_MESSAGES = 4


def light(request: pb.GenerateRequest, tokens: PromptTokenizer) -> bool:
    """Whether the request is cheap enough to validate on the event loop (services/gateway/
    fair_tokenizer.py): a tokenizer that is safe to call beside the tokenizer thread, a short
    prompt in a few messages, no tools or structured output (compiling a grammar is not cheap)."""
    return (
        tokens.reentrant
        and len(request.messages) <= LIGHT_MESSAGES
        and len(request.prompt) + sum(len(m.content) for m in request.messages) <= LIGHT_CHARS
        and len(request.prompt_token_ids) <= LIGHT_CHARS
        and not request.tools  # (tool_choice alone does nothing: none and auto need no tools)
        and not tool_chars(request)  # no calls in the messages either
        and not request.sampling.HasField("structured_output")
    )


def validate(
    request: pb.GenerateRequest,
    tokens: PromptTokenizer,
    limits: Limits,
    grammars: Grammars | None = None,
) -> ValidRequest:
    """The request's id, sampling and prompt ids; InvalidRequest with what is wrong. `grammars`
    compiles a constraint (structured output, or tool calls' JSON) to refuse one that cannot be
    used."""
    request_id = request_id_of(request)
    sampling = sampling_of(request, limits)
    sampling.constraint = _with_tools(request, sampling.constraint)
    if sampling.constraint is not None:
        if grammars is None:
            raise InvalidRequest("structured outputs are not served here")
        grammars.check(sampling.constraint)
    bounded(request, limits)
    began = time.time()
    ids = prompt_ids_of(request, tokens)
    tokenized = (began, time.time())
    if sampling.bias_token_ids and sampling.bias_token_ids[-1] >= tokens.vocab_size:
        raise InvalidRequest(
            f"logit_bias token ids must be below the vocabulary size, {tokens.vocab_size}"
        )
    if limits.max_prompt_tokens and len(ids) > limits.max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt is {len(ids)} tokens, over the limit of {limits.max_prompt_tokens}"
        )
    if len(ids) + sampling.max_tokens > limits.max_model_len:
        raise InvalidRequest(
            f"prompt ({len(ids)} tokens) plus max_tokens ({sampling.max_tokens}) "
            f"exceeds the model's context of {limits.max_model_len} tokens"
        )
    if sampling.prompt_logprobs and not rules.prompt_logprobs_fit(len(ids), sampling.top_logprobs):
        raise InvalidRequest(
            f"prompt logprobs of {len(ids)} tokens with {sampling.top_logprobs} alternatives each "
            "are more than one answer may carry: ask for fewer alternatives or a shorter prompt"
        )
    plan = plan_of(request, tokens.tool_format.parser)
    return ValidRequest(request_id, ids, sampling, tokenized, plan)
