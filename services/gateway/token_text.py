"""TokenText: each token's text and bytes as OpenAI's logprobs show them."""

import functools


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
