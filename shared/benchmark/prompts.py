"""Raw-text prompts of an exact token length, as the gateway will count them.

The gRPC API takes text, so a prompt of N tokens has to be text that the gateway's tokenizer turns
into N ids. The gateway tokenizes `prompt` with `add_special_tokens=True`; `token_count` does the
same (a unit test holds the two together). Prompts are random words of the vocabulary: tokens
that decode to a space and a short lowercase word and encode back to themselves. A byte-level
BPE that splits words before merging (SmolLM2's, GPT-2's) keeps each such word one token in any
sequence, so the first try hits the target; for other tokenizers `fit` trims or pads by words
until the count is exact.
"""

import random
import re

WORD = re.compile(r" [a-z]{2,12}")
MARKED_WORD = re.compile("[\u0120\u2581][a-z]{2,12}")  # Ġword, ▁word
MIN_WORDS = 64
MAX_WORDS = 8192  # the lowest ids: in BPE the most frequent words, and checking them is quick
MAX_FIT_STEPS = 64


class PromptError(ValueError):
    pass


def token_count(tokenizer, text: str) -> int:
    """The prompt length the gateway sees (services/gateway/validation.py: prompt_ids_of)."""
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def word_vocabulary(tokenizer) -> list[str]:
    """The vocabulary's ' word' tokens that encode back to exactly themselves, in id order."""
    candidates = (_marked_words(tokenizer) or _decoded_words(tokenizer))[:MAX_WORDS]
    texts = [text for _, text in candidates]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    words = [text for (i, text), ids in zip(candidates, encoded) if list(ids) == [i]]
    if len(words) < MIN_WORDS:
        raise PromptError(
            f"the tokenizer has only {len(words)} plain word tokens; cannot build prompts from it"
        )
    return words


def _marked_words(tokenizer) -> list[tuple[int, str]]:
    """Byte-level BPE and SentencePiece mark a leading space in the token itself ('Ġword',
    '▁word'): reading the vocabulary is much faster than decoding every id."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    found = sorted(
        (i, " " + token[1:]) for token, i in vocab.items() if MARKED_WORD.fullmatch(token)
    )
    return found if len(found) >= MIN_WORDS else []


def _decoded_words(tokenizer) -> list[tuple[int, str]]:
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [(i, text) for i, text in enumerate(texts) if WORD.fullmatch(text)]


class PromptBuilder:
    """Builds prompts of exact token lengths from seeded random words; optional shared prefixes."""

    def __init__(self, tokenizer, rng: random.Random, words: list[str] | None = None):
        self.tokenizer = tokenizer
        self.rng = rng
        self.words = words or word_vocabulary(tokenizer)
        self.specials = token_count(tokenizer, "")  # BOS and the like: part of every prompt's count

    def count(self, text: str) -> int:
        return token_count(self.tokenizer, text)

    def prefixes(self, tokens: int, number: int) -> list[str]:
        """`number` distinct texts of `tokens` tokens each (specials included), to start prompts with."""
        if tokens <= self.specials:
            raise PromptError(
                f"a shared prefix needs more than the tokenizer's {self.specials} special tokens"
            )
        return [self.build(tokens) for _ in range(number)]

    def build(self, tokens: int, prefix: str = "") -> str:
        """`prefix` followed by random words, `tokens` tokens in all (as token_count counts)."""
        floor = self.count(prefix) if prefix else self.specials
        if tokens <= floor:
            raise PromptError(
                f"a prompt of {tokens} tokens cannot hold its {floor}-token prefix "
                "and any text of its own"
            )
        return self.fit(prefix, [self._word() for _ in range(tokens - floor)], tokens)

    def fit(self, prefix: str, body: list[str], tokens: int) -> str:
        """Adds or drops words at the end until the whole text counts exactly `tokens` tokens."""
        for _ in range(MAX_FIT_STEPS):
            text = prefix + "".join(body)
            missing = tokens - self.count(text)
            if missing == 0:
                return text
            if missing > 0:
                body += [self._word() for _ in range(missing)]
            elif len(body) == 1:  # the prefix and a single word are too long already
                break
            else:
                del body[max(1, len(body) + missing) :]
        raise PromptError(f"could not fit a prompt to exactly {tokens} tokens with this tokenizer")

    def _word(self) -> str:
        return self.rng.choice(self.words)
