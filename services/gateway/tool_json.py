"""CallScan: one tool call's JSON object read as it streams, character by character.

It says where the object's top-level members lie (the call's `name`, once that string is whole;
where its arguments' value starts and, once whole, ends), and whether the object is whole or
broken (not JSON, or not a call: no string name, no arguments). Being fed by character, its
answers depend on the text alone, never on how the text was cut into pieces, which is what
keeps a streamed answer's calls the same however its chunks fall.
"""

import json
import re

_STRING_STOP = re.compile(r'["\\]')
_SCALAR = frozenset("-+.0123456789eEtruefalsn")
_SCALAR_TOKEN = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null")
_SPACE = frozenset(" \t\r\n")
# what may come next, outside a string or a scalar
START, KEY_OR_END, KEY, COLON, VALUE, VALUE_OR_END, NEXT = range(7)


class CallScan:
    """`args_keys`: the member that holds the arguments (Hermes: "arguments"; Llama 3.1 writes
    "parameters" or "arguments"); none: the object is the arguments themselves (a named
    function's constrained output). `text` holds what was read, from the object's `{`."""

    def __init__(self, args_keys: tuple[str, ...] = ()):
        self.args_keys = args_keys
        self.text = ""
        self.done = False  # the object closed, a call
        self.broken = False  # not JSON, or not a call
        self.name: str | None = None
        self.args: tuple[int, int | None] | None = (
            None  # its value's span in text (end: once whole)
        )
        self._stack: list[str] = []
        self._expect = START
        self._string: int | None = None  # where the string being read starts
        self._escape = False
        self._scalar: int | None = None  # where the scalar being read starts
        self._key: str | None = None  # the top-level member being read
        self._value: int | None = None  # where its value starts

    def feed(self, text: str) -> int:
        """Reads `text` until the object ends (or breaks): how many of its characters were read."""
        base, i = len(self.text), 0
        self.text += text
        while i < len(text) and not (self.done or self.broken):
            i = self._step(text, i, base)
        self.text = self.text[: base + i]
        return i

    @property
    def read(self) -> int:
        """Where reading stands in text: the arguments' text before it is settled."""
        return len(self.text)

    def finish(self) -> None:
        """The text ended: an object not closed is broken."""
        self.broken = self.broken or not self.done

    def _step(self, text: str, i: int, base: int) -> int:
        if self._string is not None:
            return self._in_string(text, i, base)
        c = text[i]
        if self._scalar is not None:
            if c in _SCALAR:
                return i + 1
            self._end_scalar(base + i)
            if self.broken:
                return i
        if c in _SPACE:
            return i + 1
        self._structure(c, base + i)
        return i + 1

    def _in_string(self, text: str, i: int, base: int) -> int:
        if self._escape:
            self._escape = False
            return i + 1
        stop = _STRING_STOP.search(text, i)
        if stop is None:
            return len(text)
        if text[stop.start()] == "\\":
            self._escape = True
            return stop.start() + 1
        start, self._string = self._string, None
        self._ended_string(start, base + stop.start() + 1)
        return stop.start() + 1

    def _structure(self, c: str, at: int) -> None:
        expect = self._expect
        if expect == START:
            if c != "{":
                return self._break()
            self._open(c, at)
            if not self.args_keys:
                self.args = (at, None)
        elif expect in (KEY, KEY_OR_END) and c == '"':
            self._string = at
        elif expect == KEY_OR_END and c == "}" or expect == VALUE_OR_END and c == "]":
            self._close(c, at)
        elif expect == COLON:
            self._expect = VALUE if c == ":" else self._break()
        elif expect in (VALUE, VALUE_OR_END):
            self._value_start(c, at)
        elif expect == NEXT and c == ",":
            self._expect = KEY if self._stack[-1] == "{" else VALUE
        elif expect == NEXT and c in "}]":
            self._close(c, at)
        else:
            self._break()

    def _value_start(self, c: str, at: int) -> None:
        if len(self._stack) == 1:
            self._value = at
            if self._key in self.args_keys and self.args is None:
                self.args = (at, None)
        if c == '"':
            self._string = at
        elif c in "{[":
            self._open(c, at)
        elif c in _SCALAR:
            self._scalar = at
        else:
            self._break()

    def _open(self, c: str, at: int) -> None:
        self._stack.append(c)
        self._expect = KEY_OR_END if c == "{" else VALUE_OR_END

    def _close(self, c: str, at: int) -> None:
        if (self._stack[-1], c) not in (("{", "}"), ("[", "]")):
            return self._break()
        self._stack.pop()
        if not self._stack:
            return self._closed(at + 1)
        self._expect = NEXT
        if len(self._stack) == 1:
            self._ended_value(at + 1)

    def _ended_string(self, start: int, end: int) -> None:
        if self._expect in (KEY, KEY_OR_END):
            if len(self._stack) == 1:
                self._key = json.loads(self.text[start:end])
            self._expect = COLON
            return
        self._expect = NEXT
        if len(self._stack) == 1:
            self._ended_value(end)

    def _end_scalar(self, end: int) -> None:
        start, self._scalar = self._scalar, None
        if not _SCALAR_TOKEN.fullmatch(self.text, start, end):
            return self._break()
        self._expect = NEXT
        if len(self._stack) == 1:
            self._ended_value(end)

    def _ended_value(self, end: int) -> None:
        """A top-level member's value, whole: the call's name or its arguments."""
        if self._key == "name" and self.name is None:
            name = json.loads(self.text[self._value : end])
            self.name = name if isinstance(name, str) else self._break()
        if self.args is not None and self.args[1] is None and self.args[0] == self._value:
            self.args = (self.args[0], end)

    def _closed(self, end: int) -> None:
        try:
            json.loads(self.text[:end])  # what was not checked on the way: escapes, numbers
        except ValueError:
            return self._break()
        if not self.args_keys:
            self.args = (self.args[0], end)
        elif self.name is None or self.args is None:
            return self._break()
        self.done = True

    def _break(self) -> None:
        self.broken = True
