"""What a UCX data plane keeps of failed peers and failed sends is bounded (before, both lists
grew with every failure, for the life of the process), and shutdown closes no endpoint."""

import asyncio
import time
from types import SimpleNamespace

import torch

from shared.dataplane import abandoned
from shared.dataplane.abandoned import AbandonedSends
from shared.dataplane.ucx import UcxDataPlane


def request(completed: bool):
    return SimpleNamespace(completed=completed)


def test_a_failed_sends_buffers_are_kept_until_nothing_can_read_them(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(abandoned.time, "monotonic", lambda: now[0])
    sends = AbandonedSends(max_sends=3, ttl_s=60)
    pending = request(False)
    sends.keep([pending], [torch.zeros(4)])
    sends.keep([request(True)], [torch.zeros(4)])  # its requests ended
    sends.keep([], [torch.zeros(4)])  # it failed before any request was made
    sends.keep([request(False)], [torch.zeros(4)])
    assert len(sends) == 2  # the ended ones went; the two pending ones stay
    pending.completed = True
    now[0] += 61
    for _ in range(10):
        sends.keep([request(False)], [torch.zeros(4)])
    assert len(sends) == 3  # never more than max_sends


class FakeEndpoint:
    closed = False

    async def close(self) -> None:  # closing one whose peer is gone would block
        await asyncio.sleep(3600)


async def test_retired_endpoints_are_bounded_and_shutdown_closes_none():
    plane = UcxDataPlane()
    for i in range(100):
        plane._endpoints[f"peer-{i}".encode()] = FakeEndpoint()
    for i in range(90):
        plane.forget(f"peer-{i}".encode())
    assert len(plane._retired) == UcxDataPlane.MAX_RETIRED
    started = time.monotonic()
    await asyncio.wait_for(plane.__aexit__(None, None, None), 5)
    assert time.monotonic() - started < 5 and not plane._endpoints
