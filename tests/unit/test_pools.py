"""WorkerPools and ProcessGroup.retire/reap, with stand-in processes instead of model workers."""

import json
import os
import signal
import sys
import time

import pytest

from shared.cli import scale
from shared.cli.main import parser
from shared.cli.pools import Restarts, ScaleError, WorkerPools, WorkerSpec, drain_grace_s
from shared.cli.processes import ProcessGroup
from shared.control.worker_roles import Mode

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)",
]


@pytest.fixture
def group(tmp_path):
    with ProcessGroup(tmp_path) as group:
        yield group


def pools_of(group: ProcessGroup, argv=SLEEPER, mode="disaggregated", grace_s=10.0) -> WorkerPools:
    specs = {"prefill": WorkerSpec(argv, {}), "decode": WorkerSpec(argv, {})}
    pools = WorkerPools(group, mode, specs, "127.0.0.1:1", grace_s)
    pools.resize("prefill", 1)
    pools.resize("decode", 1)
    return pools


def wait_reaped(group: ProcessGroup, timeout: float = 10) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gone = group.reap()
        if gone:
            return gone
        time.sleep(0.05)
    raise AssertionError("nothing reaped")


def test_scale_up_then_down_retires_the_newest_and_never_reuses_names(group):
    pools = pools_of(group)
    reply = pools.scale({"decode": 3})
    assert [w["name"] for w in reply["started"]] == ["decode-1", "decode-2"]
    assert reply["counts"] == {"prefill": 1, "decode": 3}
    reply = pools.scale({"decode": 1})
    assert [w["name"] for w in reply["stopping"]] == ["decode-2", "decode-1"]
    assert {w["name"] for w in reply["retiring"]} <= {"decode-1", "decode-2"}  # those not gone yet
    assert [w["name"] for w in pools.scale({"decode": 2})["started"]] == ["decode-3"]
    assert group.running() == ["prefill-0", "decode-0", "decode-3"]


def test_a_retired_worker_exiting_is_not_a_crash(group):
    pools = pools_of(group)
    pools.scale({"decode": 2})
    pid = pools.scale({"decode": 1})["stopping"][0]["pid"]
    assert wait_reaped(group) == [("decode-1", -signal.SIGTERM, False)]
    assert group.dead() == []
    assert pid not in [w["pid"] for w in pools.status()["retiring"]]


def test_a_worker_that_does_not_drain_in_time_is_killed(tmp_path):
    with ProcessGroup(tmp_path) as group:
        pools = pools_of(group, argv=STUBBORN, grace_s=0.5)
        pools.scale({"prefill": 2})
        while "ready" not in group.log_tail("prefill-1"):  # SIGTERM is ignored from here on
            time.sleep(0.05)
        pools.scale({"prefill": 1})
        assert group.reap() == []  # still inside its grace
        assert wait_reaped(group) == [("prefill-1", -signal.SIGKILL, True)]
        group.stop(grace_s=0.5)  # the others ignore SIGTERM too


def test_a_refused_request_starts_nothing(group):
    pools = pools_of(group)
    with pytest.raises(ScaleError, match="at least 1"):
        pools.scale({"prefill": 2, "decode": 0})  # checked whole before any worker starts
    assert pools.status()["counts"] == {"prefill": 1, "decode": 1}
    assert group.running() == ["prefill-0", "decode-0"]


def test_drain_grace_follows_the_workers_setting():
    assert drain_grace_s({"TANDEM_DRAIN_TIMEOUT_S": "5"}) == 5 + 15
    assert drain_grace_s({}) == drain_grace_s({"TANDEM_DRAIN_TIMEOUT_S": "soon"}) == 30 + 15


def test_wait_settled_waits_for_joiners_and_leavers(monkeypatch):
    views = iter([({1}, [{"pid": 2}]), ({1, 3}, [{"pid": 2}]), ({1, 3}, []), ({1, 3}, [])])
    current = {}

    def status(address):
        current["known"], current["retiring"] = next(views)
        return current["known"]

    monkeypatch.setattr(scale, "cluster_pids", status)
    monkeypatch.setattr(
        scale.control, "call", lambda path, req: {"ok": True, "retiring": current["retiring"]}
    )
    reply = {"address": "x", "started": [{"pid": 3}], "stopping": [{"pid": 2}]}
    scale.wait_settled("sock", reply, timeout=5, poll_s=0)
    assert current == {"known": {1, 3}, "retiring": []}
    with pytest.raises(TimeoutError, match=r"pid\(s\) \[4\]"):
        scale.wait_settled("sock", {**reply, "started": [{"pid": 4}]}, timeout=0, poll_s=0)


def test_a_colocated_stack_calls_its_pool_colocated(group):
    specs = {"decode": WorkerSpec(SLEEPER, {})}
    pools = WorkerPools(group, "colocated", specs, "127.0.0.1:1", 10.0)
    pools.resize("decode", 1)
    reply = pools.scale({"colocated": 2})
    assert reply["counts"] == {"colocated": 2} and reply["started"][0]["name"] == "decode-1"
    assert pools.scale({"decode": 1})["counts"] == {"colocated": 1}


def test_the_mode_flag_gives_a_mode_and_the_status_reads_as_before(group, capsys):
    assert parser().parse_args(["up"]).mode is Mode.AUTO
    args = parser().parse_args(["up", "--mode", "colocated"])
    assert args.mode is Mode.COLOCATED
    specs = {"decode": WorkerSpec(SLEEPER, {})}
    pools = WorkerPools(group, args.mode, specs, "127.0.0.1:1", 10.0)
    pools.resize("decode", 1)
    status = json.loads(json.dumps(pools.status()))
    assert status["mode"] == "colocated" and status["counts"] == {"colocated": 1}
    with pytest.raises(ScaleError, match="a colocated stack has no prefill workers"):
        pools.scale({"prefill": 1})
    with pytest.raises(SystemExit):
        parser().parse_args(["up", "--mode", "both"])
    assert "invalid choice: 'both' (choose from 'auto', 'disaggregated', 'colocated')" in (
        capsys.readouterr().err
    )


def test_a_crashed_worker_is_replaced_and_a_crash_loop_stops(group, monkeypatch):
    pools = pools_of(group)
    victim_name, victim_pid = pools.workers["decode"][0]
    next(p for n, p in group.children if n == victim_name).send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    replaced = []
    while not replaced and time.monotonic() < deadline:
        replaced = pools.replace_crashed()
        time.sleep(0.05)
    assert replaced == [(victim_name, -signal.SIGKILL, "decode-1")]
    assert [n for n, _ in pools.workers["decode"]] == ["decode-1"] and not group.dead()
    assert pools.replace_crashed() == []  # the new one runs: nothing to do

    # a second crash within the window: a loop
    monkeypatch.setattr("shared.cli.pools.MAX_RESTARTS", 1)
    next(p for n, p in group.children if n == "decode-1").send_signal(signal.SIGKILL)
    with pytest.raises(ScaleError, match="not restarting"):
        while time.monotonic() < deadline + 10:
            pools.replace_crashed()
            time.sleep(0.05)


def test_a_service_restarts_as_it_was_started_and_a_crash_loop_is_refused(group, monkeypatch):
    first = group.spawn("scheduler", SLEEPER, {"TANDEM_X": "1"})
    first.kill()
    first.wait()
    assert group.dead() == [("scheduler", -signal.SIGKILL)]
    again = group.restart("scheduler")
    assert again.pid != first.pid and group.running() == ["scheduler"] and not group.dead()
    monkeypatch.setattr("shared.cli.pools.MAX_RESTARTS", 2)
    restarts = Restarts()
    assert restarts.allow("nats") and restarts.allow("nats") and not restarts.allow("nats")
    assert restarts.allow("gateway")  # each service has its own count


CPUS_ECHO = [
    sys.executable,
    "-c",
    "import os, time; print('cpus', os.environ.get('TANDEM_CPUS'), flush=True); time.sleep(60)",
]


def cpus_of(group: ProcessGroup, name: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in group.log_tail(name).splitlines():
            if line.startswith("cpus "):
                return line.split()[1]
        time.sleep(0.05)
    raise AssertionError(f"{name} printed no cores")


def test_each_worker_gets_its_slot_s_cores_and_a_replacement_the_dead_one_s(group):
    from shared.worker.placement import Placement

    specs = {"prefill": WorkerSpec(CPUS_ECHO, {}), "decode": WorkerSpec(CPUS_ECHO, {})}
    placement = Placement({"prefill": [0], "decode": [1, 2, 3, 4]})
    pools = WorkerPools(group, "disaggregated", specs, "127.0.0.1:1", 10.0, placement=placement)
    pools.resize("prefill", 1)
    pools.resize("decode", 2)
    assert [cpus_of(group, n) for n in ("prefill-0", "decode-0", "decode-1")] == ["0", "1-2", "3-4"]
    victim = dict(pools.workers["decode"])["decode-0"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not group.dead() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [new for _, _, new in pools.replace_crashed()] == ["decode-2"]
    assert cpus_of(group, "decode-2") == "1-2"  # the dead worker's slot


def test_pin_puts_the_process_and_the_threads_it_starts_on_the_cores():
    import subprocess

    code = (
        "import os, threading; from shared.worker.placement import pin; n = pin('0'); "
        "seen = []; t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); "
        "t.start(); t.join(); print(n, sorted(os.sched_getaffinity(0)), sorted(seen[0]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "1 [0] [0]"
