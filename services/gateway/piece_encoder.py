"""PieceEncoder: a prompt's text encoded piece by piece between its added tokens, the pieces
remembered (a chat's system prompt and the template's own words come again and again).

The Rust tokenizer splits a text at its added tokens (<|im_start|> and the like: leftmost, the
longest first) before anything else, and encodes each piece between them on its own: the ids of
a text are its pieces' ids and the added tokens' own, in order. That holds only where no added
token strips the whitespace beside it or matches whole words only, and the tokenizer does not
normalize text; elsewhere there is no PieceEncoder (`of` gives None) and a text is encoded whole.

A short chat's template text on this machine: ~50 us encoded whole, ~20 with its system piece
remembered (the byte-level pre-tokenizer's regular expression is most of a piece's cost).
Remembered: the last MAX_PIECES pieces of at most MAX_PIECE_CHARS characters (bounded, whoever
sends them; a client that sends new text every time only ever misses).
"""

import re
import threading
from collections import OrderedDict

MAX_PIECES = 256
MAX_PIECE_CHARS = 16_384


class PieceEncoder:
    def __init__(self, backend, added: dict[str, int]):
        self._backend = backend
        self._added = added  # each added token's text -> its id
        longest_first = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")").split
        self._known: OrderedDict[str, list[int]] = OrderedDict()  # piece -> ids, oldest first
        self._lock = threading.Lock()  # the loop and the tokenizer thread both encode

    @classmethod
    def of(cls, backend) -> "PieceEncoder | None":
        """One for the Rust tokenizer `backend` where its pieces are encoded on their own."""
        tokens = backend.get_added_tokens_decoder()  # id -> AddedToken
        alone = backend.normalizer is None and not any(
            t.lstrip or t.rstrip or t.single_word for t in tokens.values()
        )
        if not alone or not tokens:
            return None
        return cls(backend, {t.content: token_id for token_id, t in tokens.items()})

    def encode(self, text: str) -> list[int]:
        """backend.encode(text, add_special_tokens=False).ids"""
        ids: list[int] = []
        for i, piece in enumerate(self._split(text)):  # text, added token, text, ...
            if i % 2:
                ids.append(self._added[piece])
            elif piece:
                ids += self._piece(piece)
        return ids

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            known = self._known.get(piece)
            if known is not None:
                self._known.move_to_end(piece)
                return known
        ids = self._backend.encode(piece, add_special_tokens=False).ids
        if len(piece) <= MAX_PIECE_CHARS:
            with self._lock:
                self._known[piece] = ids
                if len(self._known) > MAX_PIECES:
                    self._known.popitem(last=False)
        return ids
