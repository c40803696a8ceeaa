"""The launcher's control socket and `tandem scale`'s requests: parsing, validation, the JSON-line protocol."""

import socket
import stat
import threading

import pytest

from shared.cli import control
from shared.cli.control import ControlError, ControlServer
from shared.cli.pools import ScaleError, validate_targets
from shared.cli.scale import parse_targets


class FakeScaler:
    """Records requests; answers like WorkerPools, without processes."""

    def __init__(self):
        self.counts = {"prefill": 1, "decode": 1}
        self.requests = []

    def scale(self, targets) -> dict:
        self.requests.append(targets)
        counts = validate_targets(targets, "disaggregated")
        started = [
            {"name": f"{pool}-{i}", "pid": 1000 + i}
            for pool, n in counts.items()
            for i in range(self.counts[pool], n)
        ]
        self.counts.update(counts)
        return {"started": started, "stopping": [], "counts": dict(self.counts)}

    def status(self) -> dict:
        return {"counts": dict(self.counts), "retiring": []}


class Broken(FakeScaler):
    def scale(self, targets) -> dict:
        raise KeyError("/secret/internal/path")


@pytest.fixture
def serving(tmp_path):
    """serving(handler) -> the socket path of a ControlServer answering in a background thread."""
    stop = threading.Event()
    threads, servers = [], []

    def start(handler):
        server = ControlServer(tmp_path / "c.sock")
        servers.append(server)

        def serve():
            while not stop.is_set():
                server.poll(handler, 0.05)

        thread = threading.Thread(target=serve)
        thread.start()
        threads.append(thread)
        return server.path

    yield start
    stop.set()
    for thread in threads:
        thread.join(5)
    for server in servers:
        server.close()


# -- parsing and validation ------------------------------------------------------------------------


def test_parse_targets_reads_role_equals_count():
    assert parse_targets(["prefill=2", "decode=3"]) == {"prefill": 2, "decode": 3}
    assert parse_targets(["colocated=4"]) == {"colocated": 4}
    # syntax is fine; the launcher refuses the count
    assert parse_targets(["decode=-1"]) == {"decode": -1}


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([], "nothing to scale"),
        (["decode"], "ROLE=COUNT"),
        (["decode=two"], "ROLE=COUNT"),
        (["decode=2.5"], "ROLE=COUNT"),
        (["=2"], "ROLE=COUNT"),
        (["decode=1", "decode=2"], "twice"),
    ],
)
def test_parse_targets_rejects_bad_syntax(tokens, message):
    with pytest.raises(ValueError, match=message):
        parse_targets(tokens)


def test_validate_targets_maps_roles_to_pools():
    assert validate_targets({"prefill": 2, "decode": 3}, "disaggregated") == {
        "prefill": 2,
        "decode": 3,
    }
    assert validate_targets({"colocated": 2}, "colocated") == {"decode": 2}
    assert validate_targets({"decode": 2}, "colocated") == {"decode": 2}


@pytest.mark.parametrize(
    "targets, mode, message",
    [
        ({}, "disaggregated", "nothing to scale"),
        (None, "disaggregated", "nothing to scale"),
        ({"gpu": 2}, "disaggregated", "unknown role 'gpu'"),
        ({"decode": 0}, "disaggregated", "at least 1 decode worker must remain"),
        ({"prefill": -1}, "disaggregated", "at least 1 prefill worker must remain"),
        ({"decode": "2"}, "disaggregated", "whole number"),
        ({"decode": True}, "disaggregated", "whole number"),
        ({"decode": 2.0}, "disaggregated", "whole number"),
        ({"decode": 10_000}, "disaggregated", "at most"),
        ({"prefill": 2}, "colocated", "colocated stack has no prefill"),
        ({"colocated": 2}, "disaggregated", "disaggregated stack has no colocated"),
        ({"decode": 2, "colocated": 3}, "colocated", "twice"),
    ],
)
def test_validate_targets_refuses_with_a_clear_message(targets, mode, message):
    with pytest.raises(ScaleError, match=message):
        validate_targets(targets, mode)


# -- the protocol ----------------------------------------------------------------------------------


def test_scale_round_trip(serving):
    scaler = FakeScaler()
    path = serving(scaler)
    reply = control.call(path, {"op": "scale", "targets": {"decode": 3}})
    assert reply["ok"] is True
    assert [w["name"] for w in reply["started"]] == ["decode-1", "decode-2"]
    assert reply["counts"] == {"prefill": 1, "decode": 3}
    assert control.call(path, {"op": "status"}) == {
        "ok": True,
        "counts": {"prefill": 1, "decode": 3},
        "retiring": [],
    }
    assert scaler.requests == [{"decode": 3}]


def test_a_refused_request_says_why_and_changes_nothing(serving):
    scaler = FakeScaler()
    path = serving(scaler)
    reply = control.call(path, {"op": "scale", "targets": {"decode": 0}})
    assert reply == {"ok": False, "error": "decode=0: at least 1 decode worker must remain"}
    assert scaler.counts == {"prefill": 1, "decode": 1}
    assert control.call(path, {"op": "reboot"})["error"] == "unknown op 'reboot': scale or status"


def test_malformed_lines_get_an_error_reply(serving):
    path = serving(FakeScaler())
    for line in (b"not json\n", b"[1, 2]\n", b"\xff\xfe\n"):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(path))
            sock.sendall(line)
            reply = control.decode(control.read_line(sock))
        assert reply["ok"] is False and reply["error"].startswith("bad request:"), line


def test_an_internal_failure_does_not_leak_details(serving, capsys):
    path = serving(Broken())
    reply = control.call(path, {"op": "scale", "targets": {"decode": 2}})
    assert (
        reply["ok"] is False
        and "secret" not in reply["error"]
        and "see its output" in reply["error"]
    )
    assert "secret" in capsys.readouterr().err  # the traceback stays with the launcher


def test_a_silent_client_does_not_hold_the_launcher(serving, monkeypatch):
    monkeypatch.setattr(control, "ANSWER_TIMEOUT_S", 0.2)
    path = serving(FakeScaler())
    with socket.socket(socket.AF_UNIX) as silent:
        silent.connect(str(path))
        assert control.call(path, {"op": "status"}, timeout=5)["ok"] is True


# -- the socket file -------------------------------------------------------------------------------


def test_socket_is_private_and_removed_on_close(tmp_path):
    path = control.socket_path("mycluster", env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert path == tmp_path / "tandem" / "mycluster.sock"
    with ControlServer(path):
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not path.exists()


def test_default_path_without_runtime_dir_and_bad_cluster_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert control.socket_path("a", env={}) == tmp_path / ".cache" / "tandem" / "run" / "a.sock"
    assert control.socket_path("x", override="~/s.sock") == tmp_path / "s.sock"
    with pytest.raises(ControlError, match="cluster"):
        control.socket_path("../../etc/x", env={})


def test_a_stale_socket_is_taken_over(tmp_path):
    path = tmp_path / "c.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))  # a launcher that died: the file stays, nobody listens
    dead.close()
    assert path.exists()
    with ControlServer(path) as server:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert server.path == path


def test_a_second_live_launcher_is_refused(tmp_path):
    path = tmp_path / "c.sock"
    with ControlServer(path):
        with pytest.raises(ControlError, match="another tandem launcher is running"):
            ControlServer(path)
        assert path.exists()  # the refused one did not remove the live one's socket


def test_something_that_is_not_a_socket_is_left_alone(tmp_path):
    path = tmp_path / "c.sock"
    path.write_text("important")
    with pytest.raises(ControlError, match="not a socket"):
        ControlServer(path)
    assert path.read_text() == "important"


def test_closing_leaves_a_newer_launchers_socket(tmp_path):
    path = tmp_path / "c.sock"
    old = ControlServer(path)
    path.unlink()  # say an operator removed it, and a new launcher bound the path
    with ControlServer(path):
        old.close()
        assert path.exists()


def test_a_client_without_launcher_gets_a_clear_error(tmp_path):
    with pytest.raises(ControlError, match="no tandem launcher is listening"):
        control.call(tmp_path / "none.sock", {"op": "status"})
