"""StagingBuffers: a buffer given back is handed out again (no fresh pages to fault), the
smallest large enough first; one dropped (a transport may still use it) never is; no more than
`keep_bytes` wait idle."""

from shared.dataplane.staging import StagingBuffers


def test_a_buffer_given_back_is_reused_and_a_dropped_one_never_is():
    buffers = StagingBuffers(keep_bytes=1 << 20)
    first = buffers.take(1000)
    base = first.base
    buffers.give(first)
    again = buffers.take(800)  # a smaller request takes the idle buffer
    assert again.base is base and again.nbytes == 800
    buffers.drop(again)  # may still be read by a send that failed
    assert buffers.take(800).base is not base


def test_the_smallest_idle_buffer_large_enough_is_taken():
    buffers = StagingBuffers(keep_bytes=1 << 20)
    small, large = buffers.take(100), buffers.take(10_000)
    bases = small.base, large.base
    buffers.give(large), buffers.give(small)
    assert buffers.take(50).base is bases[0]
    assert buffers.take(5_000).base is bases[1]
    fresh = buffers.take(20_000).base  # none large enough: a new one
    assert all(fresh is not base for base in bases)


def test_no_more_than_keep_bytes_wait_idle():
    buffers = StagingBuffers(keep_bytes=1500)
    a, b = buffers.take(1000), buffers.take(1000)
    buffers.give(a), buffers.give(b)  # the second would exceed the limit: dropped
    assert buffers.take(1000).base is a.base
    assert buffers.take(1000).base is not b.base
