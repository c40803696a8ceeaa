"""Token ids to streamed text: valid UTF-8 only, stop strings honoured and never shown."""

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Feeds tokens one at a time; returns the text that is safe to show so far.

    Text is held back while it ends in an incomplete UTF-8 sequence, or while its tail could
    still become the start of a stop string.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._emitted = 0        # characters of the decoded text already shown
        self.stopped = False     # a stop string appeared; nothing more will be shown

    def _text(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._text()
        if self._stop:
            start = max(0, self._emitted - self._hold)
            hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._take(text, min(hits))
        if text.endswith(REPLACEMENT):
            return ""
        return self._take(text, len(text) - self._hold)

    def flush(self) -> str:
        """The held-back text at the end of the stream (nothing after a stop string)."""
        if self.stopped:
            return ""
        return self._take(self._text().rstrip(REPLACEMENT), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self._emitted:
            return ""
        piece = text[self._emitted:end]
        self._emitted = end
        return piece
