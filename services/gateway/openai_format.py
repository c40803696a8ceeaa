"""Tandem's GenerateResponses in OpenAI's shapes: chat.completion(.chunk) and text_completion,
with their logprobs, usage (cached prompt tokens included) and our `timing` as an extension. A
chat with tools gets its calls as OpenAI gives them: `message.tool_calls` beside the content
left (tool_parsers.py), or streamed as `delta.tool_calls` (tool_stream.py); finish_reason
`tool_calls` when calls were made and the model stopped by itself."""

import time

from services.gateway.echo import Echo, joined
from services.gateway.openai_request import OpenAIRequest
from services.gateway.token_text import TokenText
from services.gateway.tool_parsers import parse_output
from services.gateway.tool_request import ToolPlan
from services.gateway.tool_stream import CallDelta, StreamDelta, ToolStream, call_id
from shared.api import tandem_pb2 as pb

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


class ChoiceLog:
    """What one choice has produced so far: its text and, when asked, its logprobs (`generated`:
    False when the answer leaves out what was generated, an echo of the prompt alone)."""

    def __init__(self, generated: bool = True) -> None:
        self.generated = generated
        self.first: pb.GenerateResponse | None = None  # its prompt's logprobs come with it
        self.text = ""
        self.logprobs: list[pb.TokenLogprob] = []
        self.offsets: list[int] = []  # each token's start in the text (completions' text_offset)
        self.finish_reason: str | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        self.first = self.first or response
        if response.finish_reason:
            self.finish_reason = FINISH.get(response.finish_reason, "stop")
        if not self.generated:
            return
        self.offsets.extend([len(self.text)] * len(response.token_ids))
        self.text += response.text
        self.logprobs.extend(response.logprobs)


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


def usage(lasts: list[pb.GenerateResponse], n: int = 1, generated: bool = True) -> dict:
    """Of every choice (`lasts`: the last response of each, `n` choices per prompt): each prompt
    counted once; no completion tokens where the answer leaves them out (`generated` False)."""
    prompts = {last.index // n: last for last in lasts}.values()
    prompt = sum(last.usage.prompt_tokens for last in prompts)
    completion = sum(last.usage.completion_tokens for last in lasts) if generated else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(p.timing.cached_tokens for p in prompts)},
    }


TIMING_FIELDS = tuple(field.name for field in pb.Timing.DESCRIPTOR.fields)


def timing(last: pb.GenerateResponse) -> dict:
    """Every field of the response's Timing by its proto name, as json_format.MessageToDict
    gives it (with fields at their defaults), at a tenth of its cost (~40 us a request)."""
    t = last.timing
    return {name: getattr(t, name) for name in TIMING_FIELDS}


def delta_call(delta: CallDelta) -> dict:
    """One entry of a streamed chunk's delta.tool_calls: a call's first names it."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def with_calls(finish: str | None, called: bool) -> str | None:
    """A choice that made calls and stopped by itself finishes with `tool_calls`."""
    return "tool_calls" if called and finish == "stop" else finish


class Formatter:
    """The response objects of one OpenAI request; `tools`: how a chat's output becomes tool
    calls (None: it does not)."""

    def __init__(
        self,
        req: OpenAIRequest,
        request_id: str,
        text_of: TokenText,
        tools: ToolPlan | None = None,
    ):
        self.req, self.text_of, self.tools = req, text_of, tools
        self._tool_streams: dict[int, ToolStream] = {}  # each streamed choice's
        chat = req.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.n = max(1, req.request.sampling.n)
        prompts, only = req.echo, req.echo_only
        self.echo = Echo(prompts, self.n, text_of, only) if prompts is not None else None
        self._offsets: dict[int, int] = {}  # each streamed choice's text so far (text_offset)

    def choice_log(self) -> ChoiceLog:
        return ChoiceLog(generated=self.echo is None or not self.echo.only)

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.req.model}

    def started(self, index: int) -> bool:
        """Choice `index` has had its first streamed chunk."""
        return index in self._offsets

    def advanced(self, index: int, length: int) -> None:
        """A streamed chunk of choice `index` carried `length` characters of text, not
        formatted here (sse_events)."""
        self._offsets[index] += length

    def _logprobs(self, logprobs, offsets: list[int]) -> dict | None:
        if not self.req.logprobs:
            return None
        if self.req.kind == "chat":
            return chat_logprobs(logprobs, self.text_of)
        return completion_logprobs(logprobs, offsets, self.text_of)

    def _echoed(
        self, index: int, text: str, logprobs: dict | None, first
    ) -> tuple[str, dict | None]:
        """A completion choice's text and logprobs with its prompt before them (echo; `first`:
        the choice's first response), or as they are."""
        if self.echo is None:
            return text, logprobs
        prompt = self.echo.text(index)
        if self.echo.only:
            text, logprobs = "", (completion_logprobs([], [], self.text_of) if logprobs else None)
        if logprobs is not None:
            logprobs = joined(self.echo.logprobs(first), logprobs, len(prompt))
        return prompt + text, logprobs

    def response(self, choices: dict[int, ChoiceLog], lasts: list[pb.GenerateResponse]) -> dict:
        """The whole answer, not streamed: each choice, by index."""
        bodies = []
        for index, choice in sorted(choices.items()):
            logprobs = self._logprobs(choice.logprobs, choice.offsets)
            body = {"index": index, "logprobs": logprobs}
            finish = choice.finish_reason
            if self.req.kind == "chat":
                body["message"], finish = self._message(choice)
            else:
                body["text"], body["logprobs"] = self._echoed(
                    index, choice.text, logprobs, choice.first
                )
            bodies.append(body | {"finish_reason": finish})
        return self.head(self.object) | {
            "choices": bodies,
            "usage": self._usage(lasts),
            "system_fingerprint": None,
            "timing": timing(lasts[0]),
        }

    def _message(self, choice: ChoiceLog) -> tuple[dict, str | None]:
        """A whole chat choice's message, its calls parsed out, and its finish reason."""
        if self.tools is None:
            return {"role": "assistant", "content": choice.text}, choice.finish_reason
        parsed = parse_output(self.tools, choice.text)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [
                {
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parsed.calls
            ]
        return message, with_calls(choice.finish_reason, bool(parsed.calls))

    def _chat_delta(self, response: pb.GenerateResponse, first: bool, finish: str | None):
        """A streamed chat chunk's delta (a choice's first names the role), and its finish
        reason."""
        delta, called = self._streamed(response)
        body = {"role": "assistant"} if first else {}
        if delta.content or first and not delta.calls:
            body["content"] = delta.content
        if delta.calls:
            body["tool_calls"] = [delta_call(call) for call in delta.calls]
        return body, with_calls(finish, called)

    def _streamed(self, response: pb.GenerateResponse) -> tuple[StreamDelta, bool]:
        """What the response adds to its choice's content and tool calls."""
        if self.tools is None:
            return StreamDelta(response.text), False
        stream = self._tool_streams.get(response.index)
        if stream is None:
            stream = self._tool_streams[response.index] = ToolStream(self.tools)
        delta = stream.feed(response.text)
        if response.finish_reason:
            tail = stream.finish()
            delta.content += tail.content
            for call in tail.calls:
                delta.add(call)
        return delta, stream.called

    def chunk(self, response: pb.GenerateResponse) -> dict:
        """One streamed chunk: the response's new text (a chat stream's first names the role; a
        completion's first, with echo, starts with the prompt)."""
        finish = FINISH.get(response.finish_reason, "stop") if response.finish_reason else None
        index = response.index
        first, offset = index not in self._offsets, self._offsets.get(index, 0)
        offsets = [offset] * len(response.token_ids)
        logprobs = self._logprobs(response.logprobs, offsets)
        body = {"index": index}
        if self.req.kind == "chat":
            body["delta"], finish = self._chat_delta(response, first, finish)
            self._offsets[index] = offset + len(response.text)
        else:
            text = response.text if self.echo is None or not self.echo.only else ""
            if first:
                text, logprobs = self._echoed(index, response.text, logprobs, response)
            elif self.echo is not None and self.echo.only:
                logprobs = completion_logprobs([], [], self.text_of) if logprobs else None
            body["text"] = text
            self._offsets[index] = offset + len(text)
        body["logprobs"] = logprobs
        body["finish_reason"] = finish
        kind = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        chunk = self.head(kind) | {"choices": [body]}
        if self.req.include_usage:
            chunk["usage"] = None
        if finish:
            chunk["timing"] = timing(response)
        return chunk

    def usage_chunk(self, lasts: list[pb.GenerateResponse]) -> dict:
        """stream_options.include_usage: the stream's last chunk, with no choices."""
        kind = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return self.head(kind) | {"choices": [], "usage": self._usage(lasts)}

    def _usage(self, lasts: list[pb.GenerateResponse]) -> dict:
        return usage(lasts, self.n, self.echo is None or not self.echo.only)
