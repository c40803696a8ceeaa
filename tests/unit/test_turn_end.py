"""The chat template's own end-of-turn token ends generation, with the generation config's EOS."""

import copy
from types import SimpleNamespace

from shared.worker.end_tokens import eos_token_ids, turn_end_id

GEMMA_LIKE = (  # a turn closed by a special token that is not the EOS (<|endoftext|>, id 0 here)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
    "{% endfor %}"
)
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
STRICT = "{{ raise_exception('Conversation roles must alternate system/user') }}"


def with_template(tokenizer, template):
    twin = copy.copy(tokenizer)
    twin.chat_template = template
    return twin


def test_the_token_closing_an_assistant_turn_is_found(tokenizer):
    assert turn_end_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|im_end|>")  # ChatML
    assert turn_end_id(with_template(tokenizer, GEMMA_LIKE)) == 0


def test_plain_text_a_failing_template_or_none_give_no_token(tokenizer):
    assert turn_end_id(with_template(tokenizer, PLAIN)) is None
    assert turn_end_id(with_template(tokenizer, STRICT)) is None
    assert turn_end_id(with_template(tokenizer, None)) is None


def test_it_joins_the_generation_config_s_eos_ids(tokenizer):
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2]))
    assert eos_token_ids(model.generation_config, with_template(tokenizer, GEMMA_LIKE)) == {0, 2}
    assert eos_token_ids(model.generation_config, with_template(tokenizer, PLAIN)) == {2}
