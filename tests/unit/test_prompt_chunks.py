"""prompt_chunks: a chunk for each prompt in line first, then the rest of the budget in order."""

from shared.engine.prompt_chunks import chunk_end, share_rest


def test_whole_chunks_aligned_to_absolute_positions():
    assert chunk_end(0, 1000, 128, 512, first=True) == 512
    assert chunk_end(100, 1000, 128, 512, first=True) == 512  # 100 -> 128 is the first chunk
    assert chunk_end(960, 1000, 128, 512, first=True) == 1000  # the prompt's end
    assert chunk_end(0, 1000, 128, 100, first=False) == 0  # no whole chunk fits
    assert chunk_end(0, 1000, 128, 0, first=True) == 128  # the first prompt always advances
    assert chunk_end(0, 1000, 128, 512, first=True, most=1) == 128


def test_a_short_prompt_is_not_held_behind_a_long_one():
    """A 4,000-token prompt first in line, a 60-token one behind it: both advance this step, the
    short one to its end; the long one takes what is left."""
    line, totals, budget = [], [4000, 60], 512
    for i, total in enumerate(totals):
        end = chunk_end(0, total, 128, budget, first=not line, most=1)
        line.append([f"p{i}", end])
        budget -= end
    assert line == [["p0", 128], ["p1", 60]]
    left = share_rest(line, totals, 128, budget)
    assert line == [["p0", 384], ["p1", 60]] and left == 512 - 384 - 60


def test_the_rest_goes_in_order():
    line = [["a", 128], ["b", 128]]
    left = share_rest(line, [1000, 1000], 128, 300)
    assert line == [["a", 384], ["b", 128]] and left == 44
