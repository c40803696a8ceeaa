"""The sampling fields of an OpenAI request body as a Tandem SamplingParams message: OpenAI's
(temperature, top_p, max_tokens, seed, stop, presence_penalty, frequency_penalty, logit_bias) and
the extensions peers (vLLM, SGLang) also take (top_k, ignore_eos, repetition_penalty, min_tokens).
Fields the request leaves out get the model's defaults (`SamplingDefaults`) or OpenAI's."""

from typing import Any

from services.gateway.body_fields import BadRequest, flag, integer, number, number_in
from services.gateway.sampling_defaults import SamplingDefaults
from services.gateway.structured_request import structured_output
from shared.api import tandem_pb2 as pb
from shared.control import rules


def sampling_message(body: dict, defaults: SamplingDefaults) -> pb.SamplingParams:
    s = pb.SamplingParams(
        temperature=number(body, "temperature", defaults.temperature),  # OpenAI's: 1, sampled
        top_p=number(body, "top_p", defaults.top_p),
        top_k=max(0, integer(body, "top_k", defaults.top_k, -1, 1 << 20)),  # -1: off, as in vLLM
        ignore_eos=flag(body, "ignore_eos"),
    )
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        if body.get(name) is not None:
            s.max_tokens = integer(body, name, 0, 0, 1 << 31)  # 0: echo only (openai_request)
            break
    if body.get("seed") is not None:
        s.seed = integer(body, "seed", 0, -(1 << 63), (1 << 64) - 1) % (1 << 64)
    s.stop.extend(_stops(body.get("stop")))
    _penalties_into(s, body, defaults)
    structured = structured_output(body)
    if structured is not None:
        s.structured_output.CopyFrom(structured)
    return s


def _penalties_into(s: pb.SamplingParams, body: dict, defaults: SamplingDefaults) -> None:
    """presence_penalty, frequency_penalty and logit_bias (OpenAI's), repetition_penalty (the
    model's default where omitted) and min_tokens (vLLM's extensions)."""
    for name in ("presence_penalty", "frequency_penalty"):
        setattr(s, name, number_in(body, name, 0.0, -rules.MAX_PENALTY, rules.MAX_PENALTY))
    repetition = number_in(
        body, "repetition_penalty", defaults.repetition_penalty, 0.0, rules.MAX_REPETITION_PENALTY
    )
    if repetition <= 0:
        raise BadRequest("repetition_penalty must be above 0", "repetition_penalty")
    if repetition != 1.0:
        s.repetition_penalty = repetition
    s.min_tokens = integer(
        body, "min_tokens", 0, 0, s.max_tokens if s.HasField("max_tokens") else 1 << 31
    )
    for token, value in _logit_bias(body.get("logit_bias")).items():
        s.logit_bias[token] = value


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as strings, JSON's keys) to a number in [-100, 100]."""
    if bias is None:
        return {}
    if not isinstance(bias, dict) or len(bias) > rules.MAX_BIAS_TOKENS:
        raise BadRequest(
            f"logit_bias must map at most {rules.MAX_BIAS_TOKENS} token ids to numbers",
            "logit_bias",
        )
    out = {}
    for key in bias:
        if not _token_id(key) or bias[key] is None:
            raise BadRequest(
                f"logit_bias must map token ids to numbers, got {key!r}: {bias[key]!r}",
                "logit_bias",
            )
        value = number_in(bias, key, 0.0, -rules.MAX_LOGIT_BIAS, rules.MAX_LOGIT_BIAS, "logit_bias")
        out[int(key)] = value
    return out


def _token_id(key: str) -> bool:
    return key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < rules.TOKEN_ID_LIMIT


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    return stops
