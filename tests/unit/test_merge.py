"""merged(): the choices' streams read as one; an error in one ends them all, each cleaned up."""

import asyncio

import pytest

from services.gateway.merge import merged


async def _stream(name: str, items: int, log: list, fail: bool = False):
    try:
        for i in range(items):
            await asyncio.sleep(0.001)
            yield f"{name}{i}"
        if fail:
            raise ValueError(name)
        await asyncio.sleep(10)  # the others wait: only an error or a close ends this one
    finally:
        log.append(name)


async def test_items_of_every_stream_with_their_index():
    async def short(name):
        for i in range(3):
            yield f"{name}{i}"

    got = [item async for item in merged([short("a"), short("b")])]
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1"), (1, "b2")]


async def test_an_error_in_one_ends_all_and_is_raised():
    log: list[str] = []
    with pytest.raises(ValueError, match="b"):
        async for _ in merged([_stream("a", 2, log), _stream("b", 2, log, fail=True)]):
            pass
    assert sorted(log) == ["a", "b"]


async def test_closing_the_reader_closes_every_stream():
    log: list[str] = []
    reader = merged([_stream("a", 1, log), _stream("b", 1, log)])
    assert (await anext(reader))[1] in ("a0", "b0")
    await reader.aclose()
    assert sorted(log) == ["a", "b"]
