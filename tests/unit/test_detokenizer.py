"""Detokenizer with the real SmolLM2 tokenizer: valid UTF-8 pieces, stop strings cut exactly."""

import random

import pytest
from tokenizers.decoders import DecodeStream

from shared.engine.detokenizer import REPLACEMENT, TRIM_CHARS, Detokenizer, text_decoder

TEXTS = [
    "Hello, world! How are you today?",
    "héllo 日本語 🙂",
    "x 🇯🇵 ẞ ǅ 𝔘𝔫𝔦 ok",
    "a  b\n\n c\t😀😀😀",
]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream(tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], str, Detokenizer]:
    d = Detokenizer(tokenizer, stop)
    pieces = [d.add(i) for i in ids]
    return pieces, d.flush(), d


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [[], ["never appears in the text"]])
def test_pieces_concatenate_to_decode(tokenizer, text, stop):
    ids = ids_of(tokenizer, text)
    pieces, tail, d = stream(tokenizer, ids, stop)
    assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not d.stopped


@pytest.mark.parametrize("text", TEXTS[1:])
def test_no_piece_has_a_replacement_character(tokenizer, text):
    ids = ids_of(tokenizer, text)
    # the case is exercised
    assert any(REPLACEMENT in tokenizer.decode(ids[:n]) for n in range(1, len(ids)))
    pieces, tail, _ = stream(tokenizer, ids, [])
    assert all(REPLACEMENT not in p for p in pieces + [tail])


def test_special_tokens_are_not_shown(tokenizer):
    ids = ids_of(tokenizer, "Hi there") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    pieces, tail, _ = stream(tokenizer, ids, [])
    assert "".join(pieces) + tail == "Hi there"


@pytest.mark.parametrize(
    "text, stop, shown",
    [
        ("The answer is 42. END of the story", ["END"], "The answer is 42. "),
        ("one two three four", ["o thr"], "one tw"),  # stop spans tokens
        ("héllo 日本語 🙂 more", ["本語"], "héllo 日"),  # stop inside multi-byte chars
        ("abc\n\nUser: hi", ["\n\nUser:", "zzz"], "abc"),
        ("first stop then second", ["second", "stop"], "first "),  # earliest occurrence wins
        ("STOP at the start", ["STOP"], ""),
    ],
)
def test_stop_string_cuts_exactly(tokenizer, text, stop, shown):
    ids = ids_of(tokenizer, text)
    pieces, tail, d = stream(tokenizer, ids, stop)
    assert "".join(pieces) + tail == shown
    assert d.stopped and tail == ""


def test_stop_split_across_tokens_is_detected_on_its_last_token(tokenizer):
    ids = ids_of(tokenizer, "we say goodbye now")
    stop = "odbye n"
    # Some prefix of the token stream ends partway through the stop string.
    assert any(
        tokenizer.decode(ids[:n]).endswith(stop[:k])
        for n in range(len(ids))
        for k in range(2, len(stop))
    )
    d = Detokenizer(tokenizer, [stop])
    shown = ""
    for n, token in enumerate(ids, 1):
        shown += d.add(token)
        assert "od" not in shown  # no part of the stop ever leaks
        if stop in tokenizer.decode(ids[:n]):
            assert d.stopped
            break
        assert not d.stopped
    assert shown == "we say go"


def test_nothing_after_a_stop_is_emitted(tokenizer):
    ids = ids_of(tokenizer, "alpha STOP beta gamma delta")
    d = Detokenizer(tokenizer, ["STOP"])
    out = [d.add(i) for i in ids]
    assert d.stopped
    assert "".join(out) == "alpha "
    assert "beta" not in "".join(out) and d.flush() == ""
    assert d.add(ids[-1]) == ""


def test_flush_returns_held_text(tokenizer):
    ids = ids_of(tokenizer, "hold the end of this")
    d = Detokenizer(tokenizer, ["a long stop string"])  # holds back len-1 characters
    shown = "".join(d.add(i) for i in ids)
    assert shown == "hold the end of this"[: len(shown)] and len(shown) < len(
        "hold the end of this"
    )
    held = d.flush()
    assert held and shown + held == "hold the end of this"
    assert d.flush() == ""


def test_flush_drops_an_incomplete_character(tokenizer):
    ids = ids_of(tokenizer, "héllo 日本語")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    pieces, tail, _ = stream(tokenizer, ids[:cut], [])
    assert REPLACEMENT not in "".join(pieces) + tail


def test_each_token_decodes_a_small_window_not_the_whole_output(tokenizer):
    """A long answer must not cost O(n) per token: decode sees only the last few tokens."""
    seen = []

    class Counting:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = tokenizer("The rain in Spain stays mainly in the plain. " * 60 + " héllo 日本語 🙂")[
        "input_ids"
    ]
    detok = Detokenizer(Counting(), [])
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 500 and max(seen) <= 16


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [[], ["you today", "🙂"]])
def test_a_primed_detokenizer_goes_on_exactly_where_the_first_left_off(tokenizer, text, stop):
    """A request moved to another worker after k tokens: the pieces the first worker showed, then
    the second's, are the pieces of one undisturbed stream (held-back text included)."""
    ids = ids_of(tokenizer, text)
    pieces, tail, whole = stream(tokenizer, ids, stop)
    for k in range(len(ids)):
        first = Detokenizer(tokenizer, stop)
        shown = [first.add(i) for i in ids[:k]]
        if first.stopped:
            break  # the stream ended at its stop string: no request moves after that
        second = Detokenizer(tokenizer, stop)
        second.prime(ids[:k])
        rest = []
        for i in ids[k:]:
            rest.append(second.add(i))
            if second.stopped:
                break
        assert "".join(shown + rest) + second.flush() == "".join(pieces) + tail
        assert second.stopped == whole.stopped


def test_the_direct_decoder_gives_hugging_faces_text_and_a_stand_in_keeps_its_own(tokenizer):
    fast = text_decoder(tokenizer)
    assert fast.__code__.co_names == ("decode",)  # the Rust tokenizer's, straight
    rng = random.Random(7)
    special = list(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
        ids += rng.sample(special, k=min(len(special), rng.randrange(0, 3)))
        rng.shuffle(ids)
        assert fast(ids) == tokenizer.decode(ids, skip_special_tokens=True)

    class StandIn:
        def decode(self, ids, **kw):
            return f"<{len(ids)}>"

    assert text_decoder(StandIn())([1, 2]) == "<2>"


def shown(detokenizer: Detokenizer, ids: list[int]) -> str:
    text = ""
    for i in ids:
        text += detokenizer.add(i)
        if detokenizer.stopped:
            return text
    return text + detokenizer.flush()


@pytest.mark.parametrize(
    "stop, min_tokens, expected",
    [
        (["o"], 0, "Hell"),
        (["o"], 2, "Hello, w"),  # 'Hello' ',' are the first two: their 'o' does not count
        (["o"], 3, "Hello, world! H"),
        ([", world"], 1, "Hello"),  # one that ends after them does
        (["o"], 9, "Hello, world! How are you today?"),
    ],
)
def test_no_stop_string_within_the_first_min_tokens(tokenizer, stop, min_tokens, expected):
    """As vLLM: stop strings are looked for from the token after the first min_tokens on."""
    ids = ids_of(tokenizer, "Hello, world! How are you today?")
    assert shown(Detokenizer(tokenizer, stop, min_tokens), ids) == expected


def test_a_moved_request_s_primed_output_is_not_searched_again(tokenizer):
    """Moved after 2 tokens with min_tokens 3 (1 left on the new worker): the stream goes on as
    the undisturbed one, though its primed text holds the stop string."""
    ids = ids_of(tokenizer, "Hello, world! How are you today?")
    first = Detokenizer(tokenizer, ["o"], 3)
    before = "".join(first.add(i) for i in ids[:2])
    second = Detokenizer(tokenizer, ["o"], 1)
    second.prime(ids[:2])
    assert before + shown(second, ids[2:]) == "Hello, world! H" and second.stopped


@pytest.mark.parametrize("stop", [[], ["STOP HERE"]])
def test_a_long_answer_keeps_a_bounded_tail_and_still_finds_its_stop(tokenizer, stop):
    """Text shown, and out of a stop string's reach, is dropped: each token's text is added to
    a bounded tail (not to the whole answer), the pieces are the same, a late stop is found."""
    text = " ".join(TEXTS) * 100 + " and then STOP HERE, nothing after"
    ids = ids_of(tokenizer, text)
    d, pieces, longest = Detokenizer(tokenizer, stop), [], 0
    for i in ids:
        pieces.append(d.add(i))
        longest = max(longest, len(d._text))
    shown = "".join(pieces) + d.flush()
    assert len(text) > 5 * TRIM_CHARS and longest < 2 * TRIM_CHARS
    assert shown == (text[: text.index("STOP HERE")] if stop else text) and d.stopped == bool(stop)


class Windowed:
    """The tokenizer behind a stand-in: the Detokenizer decodes windows of tokens (its path
    for tokenizers the Rust decoder cannot stand for)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, **kw):
        return self.tokenizer.decode(ids, **kw)


def pieces_of(detokenizer: Detokenizer, ids: list[int]) -> list[str]:
    pieces = []
    for i in ids:
        pieces.append(detokenizer.add(i))
        if detokenizer.stopped:
            return pieces
    return pieces + [detokenizer.flush()]


@pytest.mark.parametrize("stop, min_tokens", [([], 0), (["o", "本語"], 0), (["you", "🙂"], 3)])
def test_the_rust_decoder_shows_what_the_window_shows_piece_for_piece(tokenizer, stop, min_tokens):
    """The incremental Rust decoder (one call a token) and the window of tokens decoded twice
    show the same pieces on the same tokens: texts, cut characters, special and random ids."""
    rng = random.Random(11)
    special = list(tokenizer.all_special_ids)
    cases = [ids_of(tokenizer, text) for text in TEXTS]
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        ids += rng.sample(special, k=min(len(special), rng.randrange(0, 3)))
        rng.shuffle(ids)
        cases.append(ids)
    for ids in cases:
        direct = Detokenizer(tokenizer, stop, min_tokens)
        assert direct._stream is not None  # the Rust decoder's path is the one tested
        windowed = Detokenizer(Windowed(tokenizer), stop, min_tokens)
        assert windowed._stream is None
        assert pieces_of(direct, ids) == pieces_of(windowed, ids)


def test_a_fork_mid_character_goes_on_as_its_twin(tokenizer):
    """A choice forked while a character is half-decoded shows what its twin shows, and the
    whole text."""
    text = "héllo 日本語 🙂 more text"
    ids = ids_of(tokenizer, text)
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    first = Detokenizer(tokenizer, [])
    shown_first = "".join(first.add(i) for i in ids[:cut])
    twin = first.fork()
    rest = pieces_of(first, ids[cut:])
    assert pieces_of(twin, ids[cut:]) == rest
    assert shown_first + "".join(rest) == text


def test_a_rust_decoder_that_gives_up_hands_over_to_the_window(tokenizer):
    """DecodeStream raises when a text does not extend its prefix: the rest of the answer comes
    from the window, the text whole."""
    text = "héllo 日本語 🙂 and then some more words"
    ids = ids_of(tokenizer, text)

    class GivesUp:
        def __init__(self, after: int):
            self.inner, self.left = DecodeStream(skip_special_tokens=True), after

        def step(self, backend, token_id):
            self.left -= 1
            if self.left < 0:
                raise Exception("Invalid prefix encountered")
            return self.inner.step(backend, token_id)

    for after in range(len(ids)):
        detokenizer = Detokenizer(tokenizer, [])
        detokenizer._stream = GivesUp(after)
        assert "".join(pieces_of(detokenizer, ids)) == text
        assert detokenizer._stream is None or after >= len(ids)
