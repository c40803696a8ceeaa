"""Token ids to streamed text: valid UTF-8 only, stop strings honoured and never shown.

As in vLLM, no stop string is looked for in the text of the first `min_tokens` output tokens
(only one that ends after them counts), nor in output a moved request was primed with: the
worker that streamed it has looked already, or was held back by min_tokens.
"""

import copy
from collections.abc import Callable

from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"
TRIM_CHARS = 1024  # text shown (out of any stop string's reach) is dropped once this much gathered
_HF_BASE = "transformers.tokenization_utils_base"
_HF_FAST = "transformers.tokenization_utils_tokenizers"


def _rust_backend(tokenizer):
    """The Rust tokenizer when decoding through it directly gives what Hugging Face's
    tokenizer.decode(ids, skip_special_tokens=True) would (a fast tokenizer, its decode not
    overridden, no clean-up of spaces); else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    plain = (
        getattr(tokenizer, "is_fast", False)
        and hasattr(backend, "decode")
        and getattr(getattr(kind, "decode", None), "__module__", "") == _HF_BASE
        and getattr(getattr(kind, "_decode", None), "__module__", "") == _HF_FAST
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )
    return backend if plain else None


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """tokenizer.decode(ids, skip_special_tokens=True); through the Rust tokenizer directly
    where that is the same: a token's text then costs ~1 us instead of ~10."""
    backend = _rust_backend(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Feeds tokens one at a time; returns the text that is safe to show so far.

    Text is held back while it ends in an incomplete UTF-8 sequence, or while its tail could
    still become the start of a stop string.

    A token's text comes from the Rust tokenizer's own incremental decoder (DecodeStream: one
    call a token, ~1.5 us) where decoding through it is Hugging Face's decode; else, or once
    that decoder finds a text that does not extend the one before (it raises), from decoding a
    window of recent tokens twice (~5 us). Both give the same text (tests/unit/test_detokenizer).
    """

    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0):
        self._decode = text_decoder(tokenizer)
        self._backend = _rust_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend else None
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        # Decoding only a small window of recent tokens keeps each step O(1) in the output length:
        # tokens [_prefix, _read) were decoded last time and give the context for the new ones.
        self._prefix = 0
        self._read = 0
        self._text = ""  # the text of tokens [0, _read), from character _base on (see _trim)
        self._base = 0  # the characters before _text: shown, and out of a stop string's reach
        self._emitted = 0  # characters of the text already shown
        self.stopped = False  # a stop string appeared; nothing more will be shown
        self._quiet = min_tokens  # tokens still to add before stop strings are looked for
        self._floor = 0  # a stop string must end past this many characters of _text

    def _pending(self) -> str:
        """The text the tokens after _read add (may end in an incomplete character)."""
        before = self._decode(self._ids[self._prefix : self._read])
        return self._decode(self._ids[self._prefix :])[len(before) :]

    def fork(self) -> "Detokenizer":
        """A twin in the same state (another choice of the request goes on from here)."""
        twin = copy.copy(self)
        twin._ids = list(self._ids)
        twin._stream = copy.copy(self._stream)
        return twin

    def prime(self, token_ids: list[int]) -> None:
        """Takes in output the client already has (a request resumed on another worker): the same
        state, held-back text included, as the worker that streamed it had, nothing shown again."""
        self._quiet += len(token_ids)
        for token_id in token_ids:
            self.add(token_id)

    def _new_text(self, token_id: int) -> str | None:
        """The text the token adds (it is in _ids already); None while that ends in an
        incomplete character (or, from the Rust decoder, while it adds nothing)."""
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token_id)
            except Exception:  # its text no longer extends its prefix: the window from here on
                self._stream = None
        new = self._pending()
        return None if new.endswith(REPLACEMENT) else new

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        quiet, self._quiet = self._quiet > 0, max(0, self._quiet - 1)
        new = self._new_text(token_id)
        if new is None:
            return ""  # wait for the rest of the character
        self._text += new
        self._prefix, self._read = self._read, len(self._ids)
        if quiet:
            self._floor = self._end()
        elif self._stop:
            start = max(0, self._emitted - self._hold)
            found = (self._find(s, max(start, self._floor - len(s) + 1)) for s in self._stop)
            hits = [i for i in found if i >= 0]
            if hits:
                self.stopped = True
                return self._take(min(hits))
        return self._take(self._end() - self._hold)

    def flush(self) -> str:
        """The held-back text at the end of the stream (nothing after a stop string)."""
        if self.stopped:
            return ""
        self._text += self._pending().rstrip(REPLACEMENT)
        self._read = len(self._ids)
        return self._take(self._end())

    def _end(self) -> int:
        """The text's length, shown or not."""
        return self._base + len(self._text)

    def _find(self, stop: str, at: int) -> int:
        found = self._text.find(stop, max(0, at - self._base))
        return found + self._base if found >= 0 else -1

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        piece = self._text[self._emitted - self._base : end - self._base]
        self._emitted = end
        self._trim()
        return piece

    def _trim(self) -> None:
        """Drops the text no search or piece will read again (shown, and before the last
        `_hold` characters a stop string may start in): adding a token's text then copies a
        bounded tail, not the whole output (a 4,096-token answer's ~20,000 characters)."""
        cut = self._emitted - self._hold - self._base
        if cut >= TRIM_CHARS:
            self._text = self._text[cut:]
            self._base += cut
