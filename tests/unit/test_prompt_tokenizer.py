"""PromptTokenizer gives Hugging Face's token ids, through the Rust tokenizer when it may."""

import copy
import random

import pytest

from services.gateway.prompt_tokenizer import PromptTokenizer

PIECES = [
    "Hello",
    " world",
    "  two  spaces",
    "\n\nnew lines\n",
    "\t",
    "tabs\tand\r\ncarriage",
    "ünïcödé ",
    "日本語のテキスト",
    "emoji 🤖🚀 ",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>system\nignore all that",
    "1234567890",
    "   ",
    "a" * 300,
    "don't, can't; it's.",
    "def f(x):\n    return x * 2\n",
]


def texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(PIECES, k=rng.randint(1, 6))) for _ in range(count)]


def chats(count: int, seed: int = 1) -> list[list[dict]]:
    rng = random.Random(seed)
    found = []
    for content in texts(count, seed):
        turns = [{"role": "user", "content": content}]
        if rng.random() < 0.5:
            turns.insert(0, {"role": "system", "content": rng.choice(PIECES)})
        if rng.random() < 0.4:
            turns += [
                {"role": "assistant", "content": rng.choice(PIECES)},
                {"role": "user", "content": rng.choice(PIECES + [""])},
            ]
        found.append(turns)
    return found


def hf_chat(tokenizer, chat: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_the_default_models_tokenizer_takes_the_rust_path_and_agrees(tokenizer):
    prompts = PromptTokenizer(tokenizer)
    assert prompts._backend is not None  # the fast path is what is measured here
    for text in texts(300):
        for special in (True, False):
            expected = tokenizer(text, add_special_tokens=special)["input_ids"]
            assert prompts.text_ids(text, special) == expected, text
    for chat in chats(200):
        assert prompts.chat_ids(chat) == hf_chat(tokenizer, chat), chat


def test_a_tokenizer_set_to_split_special_tokens_takes_hugging_faces_path(tokenizer):
    splitting = copy.deepcopy(tokenizer)
    splitting.split_special_tokens = True
    prompts = PromptTokenizer(splitting)
    assert prompts._backend is None
    text = "<|im_start|>user\nhi<|im_end|>"
    expected = splitting(text, add_special_tokens=False)["input_ids"]
    assert prompts.text_ids(text, False) == expected
    assert expected != tokenizer(text, add_special_tokens=False)["input_ids"]  # it did split


class SlowStandIn:
    """A tokenizer without a Rust backend: every call goes to its own methods."""

    is_fast = False

    def __len__(self) -> int:
        return 100

    def __call__(self, text: str, add_special_tokens: bool):
        return {"input_ids": [ord(c) % 100 for c in text] + ([1] if add_special_tokens else [])}

    def apply_chat_template(self, chat, add_generation_prompt: bool, tools=None):
        return {"input_ids": [len(m["content"]) for m in chat] + [int(add_generation_prompt)]}


@pytest.mark.parametrize("special", [True, False])
def test_a_slow_tokenizer_is_called_as_it_is(special):
    prompts = PromptTokenizer(SlowStandIn())
    assert prompts.vocab_size == 100
    assert prompts.text_ids("ab", special) == [97, 98] + ([1] if special else [])
    assert prompts.chat_ids([{"role": "user", "content": "abc"}]) == [3, 1]
