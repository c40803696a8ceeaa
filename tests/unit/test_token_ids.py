"""TokenIds reads as prompt + output would, without building it."""

from hypothesis import given
from hypothesis import strategies as st

from shared.engine.token_ids import JOIN_BELOW, TokenIds, span_ids

ids = st.lists(st.integers(0, 1000), max_size=12)


@given(ids, ids, st.integers(-30, 30), st.integers(-30, 30), st.sampled_from([None, 1, 2, -1]))
def test_a_view_reads_as_the_joined_list(prompt, output, a, b, step):
    joined, view = prompt + output, TokenIds(prompt, output)
    assert len(view) == len(joined) and list(view) == joined
    assert view[a:b:step] == joined[a:b:step] and view[a:] == joined[a:] and view[:b] == joined[:b]
    if -len(joined) <= a < len(joined):
        assert view[a] == joined[a]
    else:
        try:
            view[a]
        except IndexError:
            pass
        else:
            raise AssertionError(f"{a} out of {len(joined)} did not raise")


def test_a_view_sees_the_output_as_it_grows():
    output = [5]
    view = TokenIds([1, 2], output)
    output.append(6)
    assert view[-1] == 6 and len(view) == 4 and view[1:] == [2, 5, 6]


def test_a_short_context_is_joined_and_a_long_one_viewed():
    assert span_ids([1, 2], [3]) == [1, 2, 3] and type(span_ids([1, 2], [3])) is list
    long = span_ids(list(range(JOIN_BELOW)), [7])
    assert isinstance(long, TokenIds) and long[-1] == 7 and len(long) == JOIN_BELOW + 1
