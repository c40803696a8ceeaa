"""The token ids that end generation for a model: its generation config's, its tokenizer's, and
the one its chat template closes an assistant turn with."""

import logging

log = logging.getLogger(__name__)


def eos_token_ids(generation_config, tokenizer) -> set[int]:
    """Every id that ends generation: the generation config's (one or several), the tokenizer's,
    and the token the chat template closes an assistant turn with (`turn_end_id`)."""
    eos = generation_config.eos_token_id if generation_config else None
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    turn_end = turn_end_id(tokenizer)
    if turn_end is not None and turn_end not in eos_ids:
        log.info("the chat template ends a turn with %r: it ends generation too", turn_end)
        eos_ids.add(turn_end)
    return eos_ids


MARKER = "TANDEM-ANSWER-ENDS-HERE"


def turn_end_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant's answer (ChatML's
    <|im_end|>, Gemma's <end_of_turn>, Llama 3's <|eot_id|>, Phi-3's <|end|>), found by
    rendering one; None without a template or where plain text follows the answer. A model
    whose generation config omits it would otherwise write it and go on with another turn."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARKER}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # a template with rules of its own (roles, a system turn): no answer to read
        return None
    after = text.split(MARKER, 1)[1].lstrip() if MARKER in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if ids and ids[0] in set(tokenizer.all_special_ids) | _special_added(tokenizer):
        return ids[0]
    return None


def _special_added(tokenizer) -> set[int]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {i for i, token in decoder.items() if getattr(token, "special", False)}
