"""PromptTokenizer: a prompt's token ids, as Hugging Face's tokenizer gives them, made cheaper.

A fast (Rust) tokenizer whose encoding Hugging Face does not override is called directly: for a
short chat that is ~90 us instead of ~150 (apply_chat_template's tokenize=True goes through the
tokenizer's __call__, which validates its arguments and resets truncation and padding on every
call). The chat template is still rendered by apply_chat_template (tokenize=False), so what the
template writes is Hugging Face's. Anything else (a slow tokenizer, an overridden encoding, a
backend set to truncate, pad or split special tokens) takes Hugging Face's own path.
"""

from services.gateway.piece_encoder import PieceEncoder
from services.gateway.tool_format import ToolFormat

_HF_FAST = "transformers.tokenization_utils_tokenizers"


class PromptTokenizer:
    """`tool_parser`: the gateway's --tool-call-parser (`tool_format` says which tool format the
    chat template speaks)."""

    def __init__(self, tokenizer, tool_parser: str = "auto"):
        self.tokenizer = tokenizer
        self._backend = _plain_backend(tokenizer)
        # a text without special tokens added: piece by piece, the pieces remembered
        self._pieces = PieceEncoder.of(self._backend) if self._backend is not None else None
        template = getattr(tokenizer, "chat_template", None)  # None: the tokenizer has none
        self.tool_format = ToolFormat.of(template, tool_parser)

    @property
    def reentrant(self) -> bool:
        """Whether a call keeps no state between calls (the Rust tokenizer called directly, the
        template rendered): safe on the event loop while the tokenizer thread makes another.
        Hugging Face's own path sets truncation and padding on the tokenizer at each call."""
        return self._backend is not None

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def text_ids(self, text: str, special_tokens: bool) -> list[int]:
        """tokenizer(text, add_special_tokens=special_tokens)["input_ids"]."""
        if self._pieces is not None and not special_tokens:
            return self._pieces.encode(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=special_tokens).ids
        return list(self.tokenizer(text, add_special_tokens=special_tokens)["input_ids"])

    def chat_ids(self, chat: list[dict], tools: list[dict] | None = None) -> list[int]:
        """tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True,
        tokenize=True)."""
        render = self.tokenizer.apply_chat_template
        if self._backend is None:
            ids = render(chat, tools=tools, add_generation_prompt=True)
            return list(ids if isinstance(ids, list) else ids["input_ids"])  # or a BatchEncoding
        text = render(chat, tools=tools, add_generation_prompt=True, tokenize=False)
        if self._pieces is not None:
            return self._pieces.encode(text)
        return self._backend.encode(text, add_special_tokens=False).ids


def _plain_backend(tokenizer):
    """The Rust tokenizer when calling it gives what Hugging Face's __call__ would; else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    encode_plus = getattr(type(tokenizer), "_encode_plus", None)
    plain = (
        getattr(tokenizer, "is_fast", False)
        and hasattr(backend, "encode")
        and getattr(encode_plus, "__module__", "") == _HF_FAST
        and getattr(backend, "truncation", None) is None
        and getattr(backend, "padding", None) is None
        and not getattr(tokenizer, "split_special_tokens", False)
        and not getattr(backend, "encode_special_tokens", False)
    )
    return backend if plain else None
