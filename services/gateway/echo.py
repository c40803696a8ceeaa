"""Echo: a completion's prompt at the start of each of its choices, as OpenAI's completions API
returns it with `echo` (how lm-eval's local-completions scores multiple-choice answers).

The text is the prompt as the client gave it (token ids: decoded). With `logprobs`, the prompt's
tokens lead the choice's logprobs: the first with no log-probability (nothing precedes it), each
other with the one its worker computed from the position before it (GenerateResponse's
prompt_logprobs and prompt_token_ids, on the first response of the choice), and its text offset
within the prompt's text. With max_tokens 0 (`only`) the answer is the prompt alone.
"""

from services.gateway.token_text import TokenText
from shared.api import tandem_pb2 as pb


class Echo:
    """The echo of each prompt of a request whose choices number `n` per prompt."""

    def __init__(self, prompts: list[str | list[int]], n: int, text_of: TokenText, only: bool):
        self.prompts, self.n, self.text_of, self.only = prompts, n, text_of, only
        self._texts: dict[int, str] = {}

    def text(self, index: int) -> str:
        """The prompt text choice `index` starts with."""
        which = index // self.n
        if which not in self._texts:
            prompt = self.prompts[which]
            decoded = self.text_of.tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
            self._texts[which] = decoded
        return self._texts[which]

    def logprobs(self, first: pb.GenerateResponse) -> dict:
        """The prompt's part of a completion's logprobs (tokens, token_logprobs, top_logprobs,
        text_offset), from the choice's first response."""
        ids = list(first.prompt_token_ids)
        texts = [self.text_of(token)[0] for token in ids]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        scored = list(first.prompt_logprobs)
        return {
            "tokens": texts,
            "token_logprobs": [None] + [lp.logprob for lp in scored],
            "top_logprobs": [None] + [self._top(lp) for lp in scored],
            "text_offset": offsets,
        }

    def _top(self, lp: pb.TokenLogprob) -> dict[str, float]:
        return {self.text_of(t.token_id)[0]: t.logprob for t in lp.top}


def joined(prompt: dict, generated: dict | None, shift: int) -> dict:
    """A completion's logprobs: the prompt's, then the generated tokens' (their text offsets
    moved past the prompt's text, `shift` characters)."""
    if generated is None:
        return prompt
    return {
        "tokens": prompt["tokens"] + generated["tokens"],
        "token_logprobs": prompt["token_logprobs"] + generated["token_logprobs"],
        "top_logprobs": prompt["top_logprobs"] + generated["top_logprobs"],
        "text_offset": prompt["text_offset"] + [o + shift for o in generated["text_offset"]],
    }
