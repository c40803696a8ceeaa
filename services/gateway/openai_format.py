"""Tandem's GenerateResponses in OpenAI's shapes: chat.completion(.chunk) and text_completion,
with their logprobs, usage (cached prompt tokens included) and our `timing` as an extension."""

import functools
import time

from google.protobuf import json_format

from services.gateway.openai_request import OpenAIRequest
from shared.api import tandem_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (its tokens are bytes spelled this way)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Each token's text and UTF-8 bytes, as OpenAI's logprobs show them (cached per id). A
    byte-level token that is part of a character has its exact bytes, and its text shows them
    as "bytes:\\xe2\\x80" (OpenAI's notation)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._text(token_id)
        return found

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        decoder = _byte_decoder()
        if piece and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
        else:
            raw = self.tokenizer.decode([token_id]).encode()
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


class ChoiceLog:
    """What one choice has produced so far: its text and, when asked, its logprobs."""

    def __init__(self) -> None:
        self.text = ""
        self.logprobs: list[pb.TokenLogprob] = []
        self.offsets: list[int] = []  # each token's start in the text (completions' text_offset)
        self.finish_reason: str | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        self.offsets.extend([len(self.text)] * len(response.token_ids))
        self.text += response.text
        self.logprobs.extend(response.logprobs)
        if response.finish_reason:
            self.finish_reason = FINISH.get(response.finish_reason, "stop")


def chat_logprobs(logprobs, text_of: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {
        "content": [
            entry(lp.token_id, lp.logprob)
            | {"top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
            for lp in logprobs
        ]
    }


def completion_logprobs(logprobs, offsets: list[int], text_of: TokenText) -> dict:
    return {
        "tokens": [text_of(lp.token_id)[0] for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{text_of(t.token_id)[0]: t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def usage(lasts: list[pb.GenerateResponse]) -> dict:
    """Of every choice (`lasts`: the last response of each): the prompt counted once."""
    prompt = lasts[0].usage.prompt_tokens
    completion = sum(last.usage.completion_tokens for last in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": lasts[0].timing.cached_tokens},
    }


def timing(last: pb.GenerateResponse) -> dict:
    return json_format.MessageToDict(
        last.timing, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


class Formatter:
    """The response objects of one OpenAI request."""

    def __init__(self, req: OpenAIRequest, request_id: str, text_of: TokenText):
        self.req, self.text_of = req, text_of
        chat = req.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.req.model}

    def _logprobs(self, logprobs, offsets: list[int]) -> dict | None:
        if not self.req.logprobs:
            return None
        if self.req.kind == "chat":
            return chat_logprobs(logprobs, self.text_of)
        return completion_logprobs(logprobs, offsets, self.text_of)

    def response(self, choices: dict[int, ChoiceLog], lasts: list[pb.GenerateResponse]) -> dict:
        """The whole answer, not streamed: each choice, by index."""
        bodies = []
        for index, choice in sorted(choices.items()):
            body = {"index": index, "logprobs": self._logprobs(choice.logprobs, choice.offsets)}
            if self.req.kind == "chat":
                body["message"] = {"role": "assistant", "content": choice.text}
            else:
                body["text"] = choice.text
            bodies.append(body | {"finish_reason": choice.finish_reason})
        return self._head(self.object) | {
            "choices": bodies,
            "usage": usage(lasts),
            "system_fingerprint": None,
            "timing": timing(lasts[0]),
        }

    def chunk(self, response: pb.GenerateResponse, offset: int, first: bool = False) -> dict:
        """One streamed chunk: the response's new text (a chat stream's first names the role)."""
        finish = FINISH.get(response.finish_reason, "stop") if response.finish_reason else None
        offsets = [offset] * len(response.token_ids)
        body = {"index": response.index}
        if self.req.kind == "chat":
            body["delta"] = {"role": "assistant", "content": response.text} if first else {}
            if response.text and not first:
                body["delta"]["content"] = response.text
        else:
            body["text"] = response.text
        body["logprobs"] = self._logprobs(response.logprobs, offsets)
        body["finish_reason"] = finish
        kind = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        chunk = self._head(kind) | {"choices": [body]}
        if self.req.include_usage:
            chunk["usage"] = None
        if finish:
            chunk["timing"] = timing(response)
        return chunk

    def usage_chunk(self, lasts: list[pb.GenerateResponse]) -> dict:
        """stream_options.include_usage: the stream's last chunk, with no choices."""
        kind = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return self._head(kind) | {"choices": [], "usage": usage(lasts)}
