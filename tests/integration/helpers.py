"""Request helpers for the integration tests."""

import json
import urllib.error
import urllib.request

import torch

from shared.api import tandem_pb2 as pb


def chat_request(text: str, max_tokens: int = 32, **sampling) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))
    request.messages.add(role="user", content=text)
    return request


def collect(
    stub, request, timeout: float = 120, metadata=None
) -> tuple[list[pb.GenerateResponse], list[int], str]:
    chunks = list(stub.Generate(request, timeout=timeout, metadata=metadata))
    ids = [t for c in chunks for t in c.token_ids]
    return chunks, ids, "".join(c.text for c in chunks)


# how far a served logprob may lie from Hugging Face's float32 log-softmax: the engine computes
# in float32 too, but adds up in other orders (its own kernels, chunked prefill, batching)
LOGPROB_TOLERANCE = 2e-3


def prompt_ids(tokenizer, request: pb.GenerateRequest) -> list[int]:
    if request.messages:
        chat = [{"role": m.role, "content": m.content} for m in request.messages]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    return tokenizer(request.prompt)["input_ids"]


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Hugging Face's log-softmax [len(output), vocab] at each output position (its prefix: the
    prompt and the output before it)."""
    inputs = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(inputs).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_logprobs_match(reference: torch.Tensor, output: list[int], logprobs, top: int) -> None:
    """Each served logprob (pb.TokenLogprob, or token_id/logprob pairs) is Hugging Face's for its
    token, and its alternatives are Hugging Face's most likely, within LOGPROB_TOLERANCE."""
    assert len(logprobs) == len(output)
    for i, (token, lp) in enumerate(zip(output, logprobs)):
        row = reference[i]
        assert lp.token_id == token, i
        assert abs(lp.logprob - float(row[token])) <= LOGPROB_TOLERANCE, (i, lp, float(row[token]))
        assert len(lp.top) == top, i
        for alt in lp.top:  # ties within the tolerance may order differently
            assert abs(alt.logprob - float(row[alt.token_id])) <= LOGPROB_TOLERANCE, (i, alt)
        if top:
            best = torch.topk(row, top).values
            assert abs(lp.top[-1].logprob - float(best[-1])) <= LOGPROB_TOLERANCE, i


def hf_greedy(model, tokenizer, request: pb.GenerateRequest) -> list[int]:
    """What Hugging Face generate() answers, greedy, for the same request."""
    ids = prompt_ids(tokenizer, request)
    inputs = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=False,
            max_new_tokens=request.sampling.max_tokens,
            pad_token_id=tokenizer.eos_token_id,
        )
    return out[0, len(ids) :].tolist()


class _OutputPenalties:
    """OpenAI's frequency and presence penalties as a Hugging Face logits processor (it has none
    of its own); given to generate(), it runs after its bias and repetition penalty, in vLLM's
    order."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1])
        counts = counts[None, : scores.shape[-1]].to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_penalised_greedy(model, tokenizer, request: pb.GenerateRequest) -> list[int]:
    """What Hugging Face generate() answers, greedy, under the request's penalties, logit bias
    and min_tokens (its repetition_penalty, sequence_bias and min_new_tokens; frequency and
    presence by _OutputPenalties), stopping on the end tokens a Tandem worker stops on."""
    from transformers import LogitsProcessorList

    from shared.worker.end_tokens import eos_token_ids

    s = request.sampling
    ids = prompt_ids(tokenizer, request)
    inputs = torch.tensor([ids])
    kw = dict(repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0)
    if s.logit_bias:
        kw["sequence_bias"] = {(token,): value for token, value in s.logit_bias.items()}
    output = _OutputPenalties(len(ids), s.frequency_penalty, s.presence_penalty)
    with torch.inference_mode():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=False,
            max_new_tokens=s.max_tokens,
            min_new_tokens=s.min_tokens,
            eos_token_id=sorted(eos_token_ids(model.generation_config, tokenizer)),
            pad_token_id=tokenizer.eos_token_id,
            logits_processor=LogitsProcessorList([output]),
            **kw,
        )
    return out[0, len(ids) :].tolist()


def long_document(approx_tokens: int = 1500) -> str:
    animals = ["fox", "owl", "heron", "badger", "otter", "lynx", "crane", "marten"]
    places = ["river", "forest", "meadow", "ridge", "marsh", "valley", "glacier", "harbor"]
    lines, i = [], 0
    while len(" ".join(lines)) < approx_tokens * 2.75:
        lines.append(
            f"Observation {i}: a {animals[i % 8]} was seen near the {places[(i * 3) % 8]} "
            f"at {6 + i % 12}:{(i * 7) % 60:02d}, moving {['north', 'south', 'east', 'west'][i % 4]}."
        )
        i += 1
    return (
        "Field notes:\n" + "\n".join(lines) + "\n\nWhich animal was seen most often near the river?"
    )


def openai_streams(base_url: str, api_key: str = "unused") -> tuple[str, str]:
    """What the official `openai` client, unmodified, streams from an OpenAI-compatible API at
    `base_url` (ending in /v1): a chat answer and a text completion, greedy."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    return (
        "".join(c.choices[0].delta.content or "" for c in chat),
        "".join(c.choices[0].text for c in completion),
    )


def chat_status(base_url: str, key: str = "") -> int:
    """The HTTP status of an OpenAI chat request to the API at `base_url` (no /v1), as curl or
    any SDK sends it, with `key` (Authorization: Bearer) or without."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    headers = {"Content-Type": "application/json"}
    headers |= {"Authorization": f"Bearer {key}"} if key else {}
    url = f"{base_url}/v1/chat/completions"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code
