"""The launcher's control socket: one JSON request line in, one JSON reply line out, over a Unix socket.

Only this user reaches it: the socket is 0600, its default directory 0700, and the peer's uid is
checked. JSON only, never pickle: a request is data, not code. The launcher answers between two
ticks of its loop (`poll`), so no thread shares its process table.
"""

import json
import os
import select
import socket
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Protocol

from shared.settings import CommonSettings

MAX_LINE = 64 * 1024
ANSWER_TIMEOUT_S = 2.0  # a client that connects and says nothing must not stall the launcher's loop
CALL_TIMEOUT_S = 10.0  # for the launcher to answer `tandem scale` (it answers between two looks)
PROBE_TIMEOUT_S = 1.0  # for a socket left behind to take a connection (a launcher still there)
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, NUL included


class ControlError(RuntimeError):
    """The control socket cannot be bound or reached; the message is for the user."""


class Handler(Protocol):
    """What the socket serves. A ValueError's message goes back to the client; anything else is logged."""

    def scale(self, targets) -> dict: ...

    def status(self) -> dict: ...


def runtime_dir(env=os.environ) -> Path:
    base = env.get("XDG_RUNTIME_DIR")
    return Path(base) / "tandem" if base else Path.home() / ".cache" / "tandem" / "run"


def socket_path(cluster: str, override: str = "", env=os.environ) -> Path:
    """`override` if given, else `<runtime dir>/<cluster>.sock`."""
    if override:
        return Path(override).expanduser()
    try:
        # the one rule for cluster names; it also keeps `/` out of the path
        CommonSettings(cluster=cluster)
    except ValueError as err:
        raise ControlError(str(err)) from None
    return runtime_dir(env) / f"{cluster}.sock"


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict:
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError("not a JSON line") from None
    if not isinstance(message, dict):
        raise ValueError("a message is a JSON object")
    return message


def read_line(conn: socket.socket) -> bytes:
    """One line, within ANSWER_TIMEOUT_S in all (a client trickling bytes cannot hold the launcher)."""
    data, deadline = b"", time.monotonic() + ANSWER_TIMEOUT_S
    while not data.endswith(b"\n"):
        if time.monotonic() > deadline:
            raise ValueError("the request did not arrive in time")
        chunk = conn.recv(4096)
        if not chunk:
            raise ValueError("the peer closed the connection before a whole line")
        data += chunk
        if len(data) > MAX_LINE:
            raise ValueError(f"a line is at most {MAX_LINE} bytes")
    return data


# -- the launcher's side ------------------------------------------------------------------------


class ControlServer:
    """A listening socket at `path` (mode 0600); a stale one is taken over, a live one refused."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = _listen(path)
        self._inode = os.stat(path).st_ino

    def poll(self, handler: Handler, timeout: float) -> None:
        """Waits up to `timeout` for clients and answers each (a request is small and quick to serve)."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            with conn:
                try:
                    self._answer(conn, handler)
                except Exception as err:  # a bug answering one client must not stop the stack
                    print(
                        f"control socket: could not answer a request: {type(err).__name__}: {err}",
                        file=sys.stderr,
                        flush=True,
                    )

    def _answer(self, conn: socket.socket, handler: Handler) -> None:
        conn.settimeout(ANSWER_TIMEOUT_S)
        try:
            if not _same_user(conn):
                reply = {
                    "ok": False,
                    "error": "only the user who started the launcher may control it",
                }
            else:
                reply = dispatch(decode(read_line(conn)), handler)
        except ValueError as err:
            reply = {"ok": False, "error": f"bad request: {err}"}
        except OSError:
            return  # the client went away (or timed out): nobody to answer
        try:
            conn.sendall(encode(reply))
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        try:
            if os.stat(self.path).st_ino == self._inode:  # still ours, not a later launcher's
                self.path.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "ControlServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dispatch(request: dict, handler: Handler) -> dict:
    op = request.get("op")
    try:
        if op == "scale":
            return {"ok": True, **handler.scale(request.get("targets"))}
        if op == "status":
            return {"ok": True, **handler.status()}
        return {"ok": False, "error": f"unknown op {op!r}: scale or status"}
    except ValueError as err:
        return {"ok": False, "error": str(err)}
    except Exception:
        # the traceback stays here; the client gets a pointer to it
        traceback.print_exc(file=sys.stderr)
        return {
            "ok": False,
            "error": "the launcher failed to carry out the request; see its output",
        }


def _listen(path: Path) -> socket.socket:
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ControlError(
            f"control socket path too long for a Unix socket ({_SUN_PATH_MAX} bytes): {path}"
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            _bind_private(sock, path)
        except OSError:  # the path exists: a live launcher's socket, a stale one, or something else
            _remove_stale(path)
            _bind_private(sock, path)
        sock.listen(8)
        sock.setblocking(False)
        return sock
    except BaseException:
        sock.close()
        raise


def _bind_private(sock: socket.socket, path: Path) -> None:
    old = os.umask(0o177)  # born 0600: no window in which another user could connect
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


def _remove_stale(path: Path) -> None:
    if not path.is_socket():
        raise ControlError(f"{path} exists and is not a socket; not replacing it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()  # nobody listens: a launcher that died without cleaning up
            return
        except FileNotFoundError:
            return
        except OSError as err:
            raise ControlError(f"cannot tell whether {path} is in use: {err}") from None
    raise ControlError(
        f"another tandem launcher is running with control socket {path}; "
        "stop it first, or give this one another --cluster or --control-socket"
    )


def _same_user(conn: socket.socket) -> bool:
    if not hasattr(socket, "SO_PEERCRED"):
        return True  # the file mode alone keeps others out
    _, uid, _ = struct.unpack(
        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return uid in (os.getuid(), 0)


# -- the client's side --------------------------------------------------------------------------


def call(path: Path, request: dict, timeout: float = CALL_TIMEOUT_S) -> dict:
    """Sends one request to the launcher at `path`; returns its reply (`ok` says whether it was carried out)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(
                f"no tandem launcher is listening on {path} "
                "(is `tandem up` running, with this --cluster or --control-socket?)"
            ) from None
        except OSError as err:
            raise ControlError(f"cannot reach the launcher at {path}: {err}") from None
        try:
            sock.sendall(encode(request))
            return decode(read_line(sock))
        except TimeoutError:
            raise ControlError(
                f"the launcher did not answer within {timeout:.0f}s (is it still starting?)"
            ) from None
        except (OSError, ValueError) as err:
            raise ControlError(f"bad answer from the launcher at {path}: {err}") from None
