"""The several-hosts harness itself (tests/integration/multihost/hosts.py): hosts reach each other
over the switch, each process sees its host's name and boot id, a cut link carries nothing until
restored, and leaving removes every namespace and link it made, after a failure too."""

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shared.cli.processes import child_env
from tests.integration.multihost.hosts import BOOT_ID, Hosts, namespaces, unavailable

# connects to port 9 (discard) of the given address: refused = reachable, timeout = not
_CONNECT = """import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=1)
except ConnectionRefusedError:
    print("reachable")
except OSError:
    print("unreachable")
"""


@pytest.fixture
def log_dir():
    why = unavailable()
    if why:
        if os.environ.get("TANDEM_REQUIRE_NETNS") == "1":
            pytest.fail(f"TANDEM_REQUIRE_NETNS=1, but {why}")
        pytest.skip(why)
    return Path(tempfile.mkdtemp(prefix="tandem-mh-"))


def _reaches(hosts: Hosts, source: str, target: str) -> bool:
    address = hosts.hosts[target].address
    answer = hosts.run(source, [sys.executable, "-S", "-c", _CONNECT, address]).strip()
    return answer == "reachable"


def test_hosts_have_their_own_names_and_reach_each_other_until_cut(log_dir):
    with Hosts(["x", "y"], log_dir) as hosts:
        assert hosts.run("x", ["hostname"]).strip() == "host-x"
        boot_ids = {hosts.run(label, ["cat", BOOT_ID]) for label in ("x", "y")}
        assert len(boot_ids) == 2 and Path(BOOT_ID).read_text() not in boot_ids
        assert _reaches(hosts, "x", "y") and _reaches(hosts, "y", "x")
        hosts.cut("y")
        assert not _reaches(hosts, "x", "y")
        hosts.restore("y")
        assert _reaches(hosts, "x", "y")


def test_leaving_after_a_failure_removes_every_namespace_and_process(log_dir):
    with pytest.raises(RuntimeError, match="a test failed"), Hosts(["x", "y"], log_dir) as hosts:
        sleeper = hosts.spawn("x", "sleeper", ["sleep", "600"], child_env({}))
        made = {host.netns for host in hosts.hosts.values()} | {hosts.switch}
        assert made <= set(namespaces())
        raise RuntimeError("a test failed")
    assert sleeper.poll() is not None
    assert hosts.leftovers() == [] and not made & set(namespaces())


def test_killing_a_host_kills_every_process_on_it_and_no_other(log_dir):
    with Hosts(["x", "y"], log_dir) as hosts:
        on_x = hosts.spawn(
            "x", "x-sleeper", ["sh", "-c", "sleep 600 & exec sleep 600"], child_env({})
        )
        on_y = hosts.spawn("y", "y-sleeper", ["sleep", "600"], child_env({}))
        deadline = time.monotonic() + 30
        while len(hosts.pids("x")) < 2 or not hosts.pids("y"):
            assert time.monotonic() < deadline, (hosts.pids("x"), hosts.pids("y"))
            time.sleep(0.05)
        assert hosts.kill("x") == 2  # the shell's child too, not only the group's
        assert on_x.poll() is not None and on_y.poll() is None
        assert [name for name, _ in hosts.group.children] == ["y-sleeper"]
