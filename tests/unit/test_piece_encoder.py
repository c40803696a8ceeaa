"""A text encoded piece by piece between its added tokens, the pieces remembered, gives the ids
the Rust tokenizer gives it whole; where an added token would not leave its pieces alone
(it strips whitespace beside it), there is no PieceEncoder."""

import json
import random

from tokenizers import AddedToken, Tokenizer

from services.gateway import piece_encoder
from services.gateway.piece_encoder import PieceEncoder
from services.gateway.prompt_tokenizer import PromptTokenizer

TEXTS = [
    "",
    "plain text without anything added",
    "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|><|im_end|><|im_start|>",  # added tokens back to back
    " <|im_start|> spaces around <|im_end|>  ",
    "héllo 日本語 🙂<|im_end|>🇯🇵\n\n\t x",
    "<|im_start<|im_start|>|im_end|>",  # a token's text cut, then one whole inside it
    "<|endoftext|>" * 3 + "The end.",
]


def test_pieces_give_the_whole_texts_ids(tokenizer):
    backend = tokenizer._tokenizer
    pieces = PieceEncoder.of(backend)
    assert pieces is not None
    for text in TEXTS * 2:  # the second time from the pieces remembered
        assert pieces.encode(text) == backend.encode(text, add_special_tokens=False).ids, text


def test_random_texts_of_vocabulary_and_added_tokens(tokenizer):
    backend = tokenizer._tokenizer
    pieces = PieceEncoder.of(backend)
    rng = random.Random(5)
    vocabulary = [tokenizer.decode([i]) for i in range(0, len(tokenizer), 97)]
    added = [t.content for t in backend.get_added_tokens_decoder().values()]
    for _ in range(300):
        words = rng.choices(vocabulary + added + [" ", "\n", "  "], k=rng.randrange(1, 30))
        text = "".join(words)
        assert pieces.encode(text) == backend.encode(text, add_special_tokens=False).ids, text


def test_the_pieces_remembered_are_bounded_and_never_handed_out(tokenizer, monkeypatch):
    monkeypatch.setattr(piece_encoder, "MAX_PIECES", 4)
    backend = tokenizer._tokenizer
    pieces = PieceEncoder.of(backend)
    whole = backend.encode("a piece", add_special_tokens=False).ids
    first = pieces.encode("a piece")
    first.append(-1)  # the caller's list: the piece remembered is not changed
    assert pieces.encode("a piece") == whole
    for i in range(10):
        pieces.encode(f"piece {i}")
    assert len(pieces._known) == 4


def test_no_piece_encoder_where_an_added_token_strips_whitespace(tokenizer):
    data = json.loads(tokenizer._tokenizer.to_str())
    stripping = Tokenizer.from_str(json.dumps(data))
    stripping.add_special_tokens([AddedToken("<|strip|>", lstrip=True)])
    assert PieceEncoder.of(stripping) is None
    text = "a <|strip|> b"
    assert stripping.encode(text, add_special_tokens=False).ids  # encoded whole, as ever


def test_the_prompt_tokenizer_encodes_chats_and_texts_by_pieces(tokenizer):
    prompts = PromptTokenizer(tokenizer)
    assert prompts._pieces is not None
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"}]
    expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    expected = list(expected if isinstance(expected, list) else expected["input_ids"])
    assert prompts.chat_ids(chat) == expected
    for text in TEXTS:
        assert (
            prompts.text_ids(text, False) == tokenizer(text, add_special_tokens=False)["input_ids"]
        )
        assert prompts.text_ids(text, True) == tokenizer(text)["input_ids"]
