"""Placement: disjoint cores per pool, a slice per worker, NUMA node by node."""

from functools import partial
from pathlib import Path

import pytest

from shared.worker import placement as placement_module
from shared.worker.placement import Placement, format_cpus, numa_order, parse_cpus

place = partial(placement_module.place, nodes=Path("/nonexistent"))  # no NUMA nodes: CPU order


def test_cpu_lists_parse_and_format():
    assert parse_cpus("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpus("5") == [5]
    assert format_cpus([6, 0, 1, 2, 3]) == "0-3,6"
    for bad in ("", "a", "3-1", "1,,2", "-1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_two_cores_give_each_pool_its_own():
    placement = place([0, 1], {"prefill": 1, "decode": 1}, {})
    assert placement.pools == {"prefill": [0], "decode": [1]}
    assert placement.share_of("decode", 0, 1) == [1]


def test_pools_split_in_proportion_to_their_sizes():
    placement = place(list(range(16)), {"prefill": 1, "decode": 3}, {})
    assert placement.pools == {"prefill": list(range(4)), "decode": list(range(4, 16))}
    assert [placement.share_of("decode", s, 3) for s in range(3)] == [
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    odd = place(list(range(7)), {"prefill": 1, "decode": 1}, {})
    assert odd.pools == {"prefill": [0, 1, 2, 3], "decode": [4, 5, 6]}  # every core used
    assert odd.share_of("prefill", 0, 3) == [0, 1] and odd.share_of("prefill", 2, 3) == [3]


def test_a_pool_past_its_cores_shares_them_and_never_takes_the_other_s():
    placement = place([0, 1, 2, 3], {"prefill": 1, "decode": 1}, {})
    assert [placement.share_of("decode", s, 5) for s in range(5)] == [[2], [3], [2], [3], [2]]
    single = place([0], {"prefill": 1, "decode": 1}, {})  # nothing to separate
    assert single.pools == {"prefill": [0], "decode": [0]}


def test_given_cores_are_used_and_the_other_pool_gets_the_rest():
    placement = place(list(range(8)), {"prefill": 2, "decode": 2}, {"decode": "6-7"})
    assert placement.pools == {"prefill": list(range(6)), "decode": [6, 7]}
    both = place(list(range(8)), {"prefill": 1, "decode": 1}, {"prefill": "0", "decode": "0-7"})
    assert both.pools == {"prefill": [0], "decode": list(range(8))}  # overlap asked for
    with pytest.raises(ValueError, match="not all of them are available"):
        place([0, 1], {"prefill": 1, "decode": 1}, {"decode": "4"})
    with pytest.raises(ValueError, match="no cpus left for the prefill pool"):
        place([0, 1], {"prefill": 1, "decode": 1}, {"decode": "0-1"})


def test_a_colocated_stack_has_one_pool_on_every_core():
    assert place([0, 1, 2], {"decode": 2}, {"prefill": "0"}).pools == {"decode": [0, 1, 2]}


def test_cores_are_taken_numa_node_by_node(tmp_path):
    for node, cpus in (("node0", "0-3,8-11"), ("node1", "4-7,12-15")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    order = numa_order(list(range(16)), tmp_path)
    assert order == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    assert numa_order([1, 5, 20], tmp_path) == [1, 5, 20]  # 20: on no node listed, last
    halves = Placement({"decode": order}).share_of
    assert halves("decode", 0, 2) == [0, 1, 2, 3, 8, 9, 10, 11]  # one node each


def test_gpus_are_counted_from_the_driver_or_cuda_visible_devices(tmp_path):
    from shared.worker.placement import gpus_available

    for bus in ("0000:01:00.0", "0000:41:00.0", "0000:81:00.0"):
        (tmp_path / bus).mkdir()
    assert gpus_available({}, tmp_path) == [0, 1, 2]
    assert gpus_available({"CUDA_VISIBLE_DEVICES": "2,3"}, tmp_path) == [0, 1]
    assert gpus_available({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == []
    assert gpus_available({}, tmp_path / "absent") == []


def test_each_worker_gets_a_gpu_of_its_pool_s_own(monkeypatch):
    from types import SimpleNamespace

    from shared.cli.pools import devices_of

    monkeypatch.delenv("TANDEM_DEVICE", raising=False)
    args = SimpleNamespace(
        mode="disaggregated", prefill=2, decode=2, prefill_devices="", decode_devices=""
    )
    devices = devices_of(args, gpus=list(range(8)))
    assert devices.pools == {"prefill": [0, 1, 2, 3], "decode": [4, 5, 6, 7]}
    assert [devices.share_of("decode", s, 2)[0] for s in range(2)] == [4, 6]
    assert devices_of(args, gpus=[]) is None  # a CPU host
    given = SimpleNamespace(**{**vars(args), "decode_devices": "7"})
    assert devices_of(given, gpus=list(range(8))).pools == {
        "prefill": list(range(7)),
        "decode": [7],
    }
    with pytest.raises(ValueError, match="--decode-devices 9"):
        devices_of(SimpleNamespace(**{**vars(args), "decode_devices": "9"}), gpus=[0, 1])
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")
    assert devices_of(args, gpus=list(range(8))) is None  # the user's choice for every worker


def test_cores_that_cannot_be_had_are_refused_plainly():
    import subprocess
    import sys

    worker = subprocess.run(
        [sys.executable, "-m", "services.decode", "--cpus", "4095"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 2, worker.stderr
    assert "cannot run on cores 4095" in worker.stderr
    up = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", "up", "--decode-cpus", "4095"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 2 and "--decode-cpus 4095: not all of them are available" in up.stderr
