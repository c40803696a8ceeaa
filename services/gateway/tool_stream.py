"""ToolStream: one choice's text, streamed as OpenAI streams tool calls.

Text before a call streams as content. Where a call's marker may be starting, only the characters
that could be that marker's start are held back (never text that cannot be part of a call). A
call is announced once its name is whole and its arguments have begun (`{index, id, type:
"function", function: {name, arguments: ""}}`); its arguments then stream as they come, as the
model wrote them (`{index, function: {arguments}}`); they are the same JSON as the whole answer's,
which is re-serialized (json.dumps). Text outside the calls after the first one is dropped, as the
whole answer's parsers drop it.

The text is read character by character (tool_json.CallScan), so the content and the calls a
stream gives are the same however the text was cut into pieces. A call whose JSON breaks before
any call was announced leaves the whole output as content, as a whole answer would; once one has
been announced it cannot be taken back: the stream's calls end there and the rest is dropped.

The formats (tool_parsers.py says each): Hermes's `<tool_call>` may come anywhere; Llama 3.1's
calls only at the start of the output (as vLLM streams them); Mistral's after `[TOOL_CALLS]`, or
at the start; the constrained `required` and `function` outputs are calls from their start.
"""

import secrets
from dataclasses import dataclass, field
from enum import Enum, auto

from services.gateway.tool_json import CallScan
from services.gateway.tool_parsers import MISTRAL_MARKER, PYTHON_TAG
from services.gateway.tool_request import ToolPlan


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Format:
    marker: str = ""  # calls start after it, anywhere in the text
    at_start: str = ""  # or at the output's start (after whitespace) with this character
    skip: str = ""  # a marker the output may start with, left out (Llama's python tag)
    array: bool = False  # the calls are the items of a JSON array
    close: str = ""  # each call ends with it (Hermes's closing tag)
    separator: str = ""  # another call may follow it (Llama's ";")
    args_keys: tuple[str, ...] = ("arguments",)  # none: the object is the arguments


FORMATS = {
    "hermes": Format(marker="<tool_call>", close="</tool_call>"),
    "llama3_json": Format(
        at_start="{", skip=PYTHON_TAG, separator=";", args_keys=("arguments", "parameters")
    ),
    "mistral": Format(marker=MISTRAL_MARKER, at_start="[", array=True),
    "required": Format(at_start="[", array=True, args_keys=("parameters",)),
    "function": Format(at_start="{", args_keys=()),
}


class Mode(Enum):
    START = auto()  # at the output's start: is it a call?
    TEXT = auto()  # content, watching for the marker
    OPEN = auto()  # a call's object (or the array of them) comes next
    OBJECT = auto()  # in a call's object
    AFTER = auto()  # after a call's object: its closing tag, a separator, the array's end
    SEEK = auto()  # after a Hermes call: another marker, the text between dropped
    PLAIN = auto()  # content to the end: no call (any more)
    DROP = auto()  # the rest is dropped


@dataclass
class CallDelta:
    index: int
    arguments: str = ""
    id: str | None = None  # with name, on a call's first delta
    name: str | None = None


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, delta: CallDelta) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == delta.index and delta.id is None:
            last.arguments += delta.arguments
        else:
            self.calls.append(delta)


class ToolStream:
    def __init__(self, plan: ToolPlan):
        self.plan, self.format = plan, FORMATS[plan.parser]
        self.mode = Mode.START if self.format.at_start else Mode.TEXT
        self.seen = ""  # all text fed
        self.emitted = 0  # of it, given as content
        self.pending = ""  # not yet read
        self.calls = 0  # calls announced (or, past the first without parallel calls, found)
        self.scan: CallScan | None = None
        self.announced = False  # the call being read was
        self.args_sent = 0  # characters of its arguments given
        self.in_array = False
        self._out = StreamDelta()

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> StreamDelta:
        self.seen += text
        self.pending += text
        while self._step():
            pass
        return self._taken()

    def finish(self) -> StreamDelta:
        """The text ended: what was held back, or the rest of a call that did not close."""
        while self._step():
            pass
        mode, rest = self.mode, self.pending
        if mode == Mode.OBJECT:
            self.scan.finish()
            self._broken()
        elif mode == Mode.OPEN or mode == Mode.AFTER and (self.format.array or rest.strip()):
            self._broken()
        elif mode in (Mode.START, Mode.TEXT, Mode.PLAIN):
            self._content(rest)
        self.pending = ""
        return self._taken()

    def _taken(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    def _content(self, text: str) -> None:
        self._out.content += text
        self.emitted += len(text)

    def _step(self) -> bool:
        """Reads what it can of the pending text; False once it needs more."""
        if not self.pending:
            return False
        return STEPS[self.mode](self)

    def _start(self) -> bool:
        text = self.pending.lstrip()
        skip, marker = self.format.skip, self.format.marker
        if not text or any(m.startswith(text) for m in (skip, marker) if m):
            return False  # whitespace, or maybe a marker: held
        if marker and text.startswith(marker):
            self.mode = Mode.TEXT
        elif skip and text.startswith(skip):
            self.pending, self.mode = text[len(skip) :], Mode.OPEN
        elif text[0] == self.format.at_start:
            self.pending, self.mode = text, Mode.OPEN
        else:
            self.mode = Mode.TEXT if self.format.marker else Mode.PLAIN
        return True

    def _text(self) -> bool:
        marker, text = self.format.marker, self.pending
        found = text.find(marker)
        if found >= 0:
            self._content(text[:found])
            self.pending, self.mode = text[found + len(marker) :], Mode.OPEN
            return True
        held = _marker_start(text, marker)
        self._content(text[: len(text) - held])
        self.pending = text[len(text) - held :]
        return False

    def _open(self) -> bool:
        text = self.pending.lstrip()
        self.pending = text
        if not text:
            return False
        if self.format.array and not self.in_array:
            if text[0] != "[":
                return self._broken()
            self.pending, self.in_array = text[1:], True
            return True
        if text[0] != "{":
            return self._broken()
        self.scan, self.announced, self.args_sent = CallScan(self.format.args_keys), False, 0
        self.mode = Mode.OBJECT
        return True

    def _object(self) -> bool:
        scan = self.scan
        read = scan.feed(self.pending)
        self.pending = self.pending[read:]
        self._call_deltas(scan)
        if scan.broken:
            return self._broken()
        if scan.done:
            self.mode = Mode.AFTER
        return scan.done

    def _after(self) -> bool:
        text = self.pending.lstrip()
        self.pending, fmt = text, self.format
        if not text:
            return False
        if fmt.close and text.startswith(fmt.close):
            self.pending, self.mode = text[len(fmt.close) :], Mode.SEEK
        elif fmt.close and fmt.close.startswith(text):
            return False  # maybe the closing tag: held
        elif fmt.separator:
            self.pending = text[1:] if text[0] == fmt.separator else ""
            self.mode = Mode.OPEN if text[0] == fmt.separator else Mode.DROP
        elif fmt.array and text[0] in ",]":
            self.pending = text[1:]
            self.mode = Mode.OPEN if text[0] == "," else Mode.DROP
        else:
            return self._broken()
        return True

    def _seek(self) -> bool:
        marker, text = self.format.marker, self.pending
        found = text.find(marker)
        if found < 0:
            self.pending = text[len(text) - _marker_start(text, marker) :]
            return False
        self.pending, self.mode = text[found + len(marker) :], Mode.OPEN
        return True

    def _plain(self) -> bool:
        self._content(self.pending)
        self.pending = ""
        return False

    def _drop(self) -> bool:
        self.pending = ""
        return False

    def _broken(self) -> bool:
        """Not a call: all of the output is content while no call was announced; else the
        stream's calls end here."""
        if self.calls == 0:
            self._content(self.seen[self.emitted :])
            self.mode = Mode.PLAIN
        else:
            self.mode = Mode.DROP
        self.pending = ""
        return False

    def _call_deltas(self, scan: CallScan) -> None:
        name = scan.name if self.format.args_keys else self.plan.function
        if not self.announced:
            if name is None or scan.args is None:
                return
            self.announced, self.calls = True, self.calls + 1
            self._add(CallDelta(self.calls - 1, id=call_id(), name=name))
        start, end = scan.args
        upto = scan.read if end is None else min(end, scan.read)
        fragment = scan.text[start + self.args_sent : upto]
        self.args_sent += len(fragment)
        if fragment:
            self._add(CallDelta(self.calls - 1, fragment))

    def _add(self, delta: CallDelta) -> None:
        if self.plan.parallel or delta.index == 0:
            self._out.add(delta)


STEPS = {
    Mode.START: ToolStream._start,
    Mode.TEXT: ToolStream._text,
    Mode.OPEN: ToolStream._open,
    Mode.OBJECT: ToolStream._object,
    Mode.AFTER: ToolStream._after,
    Mode.SEEK: ToolStream._seek,
    Mode.PLAIN: ToolStream._plain,
    Mode.DROP: ToolStream._drop,
}


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
