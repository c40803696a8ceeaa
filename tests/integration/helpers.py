"""Request helpers for the integration tests."""

import torch

from shared.api import tandem_pb2 as pb


def chat_request(text: str, max_tokens: int = 32, **sampling) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))
    request.messages.add(role="user", content=text)
    return request


def collect(
    stub, request, timeout: float = 120
) -> tuple[list[pb.GenerateResponse], list[int], str]:
    chunks = list(stub.Generate(request, timeout=timeout))
    ids = [t for c in chunks for t in c.token_ids]
    return chunks, ids, "".join(c.text for c in chunks)


def hf_greedy(model, tokenizer, request: pb.GenerateRequest) -> list[int]:
    """What Hugging Face generate() answers, greedy, for the same request."""
    if request.messages:
        chat = [{"role": m.role, "content": m.content} for m in request.messages]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
    else:
        ids = tokenizer(request.prompt)["input_ids"]
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
