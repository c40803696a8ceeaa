"""How far each prompt in line is computed in one step: whole chunks within a token budget.

Chunks are aligned to absolute positions (a prompt's bits do not depend on how its computation
was cut). A step first gives each prompt in line one chunk, in order (the first prompt one at
least, whatever the budget), so that a short prompt is never held behind a long one for the whole
of the long one's prefill; what is left of the budget then goes to the prompts in order.
"""


def chunk_end(start: int, total: int, chunk: int, budget: int, first: bool, most: int = 0) -> int:
    """The end of the whole chunks from `start` (at most `most` of them; 0 = no limit) that fit
    `budget`; one at least when `first`."""
    end, taken = start, 0
    while end < total and (not most or taken < most):
        nxt = min(total, (end // chunk + 1) * chunk)
        if nxt - start > budget and not (first and end == start):
            break
        end, taken = nxt, taken + 1
    return end


def share_rest(line: list[list], totals: list[int], chunk: int, budget: int) -> int:
    """Extends each [item, end] of `line` (its prompt `totals[i]` tokens long) by whole chunks,
    in order, while `budget` lasts; the budget left."""
    for entry, total in zip(line, totals, strict=True):
        end = chunk_end(entry[1], total, chunk, budget, first=False)
        budget -= end - entry[1]
        entry[1] = end
    return budget
