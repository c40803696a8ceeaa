"""Token-length distributions for prompts and outputs: `fixed:N`, `uniform:A-B` and `file:PATH`.

A file holds one length per line, or `prompt_len output_len` pairs (blank lines and `#` comments
are skipped). Its rows are drawn at random with the workload's seeded generator; when the prompt
and output lengths come from the same pair file, both come from the same row, so the pairs of a
real trace stay together.
"""

import random
from dataclasses import dataclass
from pathlib import Path


class LengthSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fixed:
    value: int

    def draw(self, rng: random.Random) -> int:
        return self.value


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int  # inclusive

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class FromFile:
    path: str
    rows: tuple[tuple[int, ...], ...]
    column: int  # 0 for prompt lengths, 1 for output lengths (a one-column file always uses 0)

    def value(self, row: int) -> int:
        cells = self.rows[row]
        return cells[min(self.column, len(cells) - 1)]

    def draw(self, rng: random.Random) -> int:
        return self.value(rng.randrange(len(self.rows)))


Lengths = Fixed | Uniform | FromFile


def parse_lengths(spec: str, column: int = 0) -> Lengths:
    """`fixed:N` (or just `N`), `uniform:A-B` (inclusive) or `file:PATH`; every length is >= 1."""
    kind, _, arg = spec.partition(":")
    if not arg and kind.strip().isdigit():
        kind, arg = "fixed", kind
    if kind == "fixed":
        return Fixed(_positive(arg, spec))
    if kind == "uniform":
        low, sep, high = arg.partition("-")
        if not sep:
            raise LengthSpecError(f"{spec!r}: write uniform:A-B, e.g. uniform:64-512")
        low, high = _positive(low, spec), _positive(high, spec)
        if low > high:
            raise LengthSpecError(f"{spec!r}: the low end {low} is above the high end {high}")
        return Uniform(low, high)
    if kind == "file":
        return FromFile(arg, read_rows(arg), column)
    raise LengthSpecError(f"{spec!r}: expected fixed:N, uniform:A-B or file:PATH")


def read_rows(path: str) -> tuple[tuple[int, ...], ...]:
    """The file's rows: all of one integer, or all of two; anything else is an error naming the line."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as err:
        raise LengthSpecError(f"file:{path}: cannot read it ({err.strerror or err})") from None
    rows = []
    for number, line in enumerate(lines, 1):
        cells = line.split("#", 1)[0].split()
        if not cells:
            continue
        if len(cells) > 2:
            raise LengthSpecError(
                f"{path}:{number}: expected one length or 'prompt_len output_len', got {line!r}"
            )
        rows.append(tuple(_positive(cell, f"{path}:{number}") for cell in cells))
    if not rows:
        raise LengthSpecError(f"file:{path}: no lengths in it")
    if len({len(row) for row in rows}) > 1:
        raise LengthSpecError(f"file:{path}: mixes one-length and two-length lines")
    return tuple(rows)


def draw_pair(prompt: Lengths, output: Lengths, rng: random.Random) -> tuple[int, int]:
    """One request's (prompt_len, output_len); one row for both when they read the same file."""
    if isinstance(prompt, FromFile) and isinstance(output, FromFile) and prompt.rows is output.rows:
        row = rng.randrange(len(prompt.rows))
        return prompt.value(row), output.value(row)
    return prompt.draw(rng), output.draw(rng)


def parse_output_lengths(spec: str | None, prompt: Lengths, default: str = "fixed:128") -> Lengths:
    """The output lengths. No spec: the second column of the prompt's pair file, else `default`.
    A file the prompt lengths already read is not read again, so draw_pair sees one set of rows
    and keeps each pair together."""
    paired = isinstance(prompt, FromFile) and len(prompt.rows[0]) == 2
    if (spec is None and paired) or (
        isinstance(prompt, FromFile) and spec == f"file:{prompt.path}"
    ):
        return FromFile(prompt.path, prompt.rows, 1)
    return parse_lengths(spec or default, column=1)


def _positive(text: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise LengthSpecError(f"{where}: {text!r} is not an integer") from None
    if value < 1:
        raise LengthSpecError(f"{where}: lengths must be at least 1, got {value}")
    return value
