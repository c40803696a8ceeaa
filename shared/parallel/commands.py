"""The command link of a tensor-parallel group: rank 0 tells every other rank what to run next.

One stream socket per follower (a socket pair rank 0 made when it started the rank, or a
connection in a test), carrying frames of int64s: a header [op, length] then `length` values.
Never pickled. A follower blocks on its socket with no timeout: between requests a group may idle
for hours, and rank 0 gone shows at once as the end of the stream (`GroupGone`). A dead follower
shows to rank 0 as a broken pipe on its next command, or as a failed collective.
"""

import enum
import socket

import numpy

HEADER = 2  # int64s: op, payload length


class Op(enum.IntEnum):
    STOP = 0
    FORWARD = 1
    COPY_BLOCK = 2


class GroupGone(ConnectionError):
    """The other end of a command link closed: its process exited."""


class CommandWriter:
    """Rank 0's end: sends each command to every follower."""

    def __init__(self, sockets: list[socket.socket]):
        self.sockets = sockets

    def send(self, op: Op, payload: list[int]) -> None:
        frame = numpy.array([int(op), len(payload), *payload], dtype=numpy.int64).tobytes()
        for rank, sock in enumerate(self.sockets, start=1):
            try:
                sock.sendall(frame)
            except OSError as err:
                raise GroupGone(f"rank {rank} is gone: {err}") from None

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


class CommandReader:
    """A follower's end: the next command, blocking until rank 0 sends one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def _read(self, count: int) -> numpy.ndarray:
        want, chunks = count * 8, []
        while want:
            chunk = self.sock.recv(min(want, 1 << 20))
            if not chunk:
                raise GroupGone("rank 0 closed the command link")
            chunks.append(chunk)
            want -= len(chunk)
        return numpy.frombuffer(b"".join(chunks), dtype=numpy.int64)

    def receive(self) -> tuple[Op, list[int]]:
        op, length = (int(v) for v in self._read(HEADER))
        return Op(op), (self._read(length).tolist() if length else [])
