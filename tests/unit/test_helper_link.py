"""The worker's data-plane helper: its timing comes from the worker's settings, and the buffers
it names are told apart by type (a torch tensor or a numpy array), not by probing them."""

from types import SimpleNamespace

import numpy
import pytest
import torch

from shared.dataplane.helper_link import HelperTiming
from shared.dataplane.helper_plane import HelperDataPlane
from shared.engine.shared_region import SharedRegion
from shared.worker.links import data_plane
from shared.worker.settings import WorkerSettings


def test_the_helper_settings_reach_the_helper_link():
    settings = WorkerSettings(
        kv_helper_start_timeout_s=5.0, kv_helper_hang_s=4.0, kv_helper_ping_s=0.5
    )
    pool = SimpleNamespace(region=SharedRegion(4096))
    runtime = SimpleNamespace(pools=[pool], runner=SimpleNamespace(device="cpu"))
    plane = data_plane(settings, runtime)
    assert isinstance(plane, HelperDataPlane)
    assert plane._link.timing == HelperTiming(start_s=5.0, hang_s=4.0, ping_s=0.5)


def test_by_default_the_helper_is_given_what_the_settings_default_to():
    assert WorkerSettings().helper_timing() == HelperTiming()


@pytest.mark.parametrize(
    "values",
    [
        {"kv_helper_start_timeout_s": 0},
        {"kv_helper_hang_s": float("nan")},
        {"kv_helper_ping_s": -1},
        {"kv_helper_ping_s": 10.0, "kv_helper_hang_s": 10.0},  # pings as slow as the hang limit
    ],
)
def test_helper_timings_that_cannot_work_are_refused(values):
    with pytest.raises(ValueError):
        WorkerSettings(**values)


def test_a_torch_tensor_and_a_numpy_array_in_the_region_are_named_alike():
    region = SharedRegion(4096)
    plane = HelperDataPlane([region])
    as_numpy = region.view(1024, 512)
    as_torch = region.tensor()[1024:1536]
    assert plane._ref(as_numpy) == plane._ref(as_torch) == [0, 1024, 512]
    assert plane._ref([as_numpy, as_torch]) == [[0, 1024, 512]] * 2


def test_a_buffer_that_is_not_contiguous_is_refused_whatever_its_type():
    region = SharedRegion(4096)
    plane = HelperDataPlane([region])
    with pytest.raises(ValueError, match="contiguous"):
        plane._ref(region.view(0, 1024)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        plane._ref(region.tensor()[:1024].view(32, 32).t())
    with pytest.raises(ValueError, match="outside"):
        plane._ref(numpy.zeros(16, dtype=numpy.uint8))
    with pytest.raises(ValueError, match="outside"):
        plane._ref(torch.zeros(16, dtype=torch.uint8))
