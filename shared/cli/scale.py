"""`tandem scale prefill=N decode=M`: grows or shrinks the worker pools of a running `tandem up`.

The launcher answers at once; with --wait this command then watches until the new workers are in
the scheduler's ClusterStatus (their model is loaded and they announced) and the retired ones
have left it and exited.
"""

import re
import sys
import time

import grpc

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.cli import control
from shared.cli.client import STATUS_TIMEOUT_S, key_metadata

_TARGET = re.compile(r"([a-z]+)=(-?\d+)")
POLL_S = 0.5  # how often --wait looks


def parse_targets(tokens: list[str]) -> dict[str, int]:
    """["prefill=2", "decode=3"] -> {"prefill": 2, "decode": 3}; ValueError on bad syntax.

    Which roles exist and which counts are allowed is the launcher's call (it knows the mode).
    """
    targets: dict[str, int] = {}
    for token in tokens:
        match = _TARGET.fullmatch(token)
        if not match:
            raise ValueError(f"expected ROLE=COUNT (like decode=2), got {token!r}")
        role, count = match.group(1), int(match.group(2))
        if role in targets:
            raise ValueError(f"{role} is given twice")
        targets[role] = count
    if not targets:
        raise ValueError("nothing to scale: give prefill=N and/or decode=M")
    return targets


def describe(reply: dict) -> str:
    lines = [
        f"started {w['name']} (pid {w['pid']}): loading the model; it takes work once it announces"
        for w in reply["started"]
    ]
    lines += [
        f"stopping {w['name']} (pid {w['pid']}): finishing its requests, then exiting"
        for w in reply["stopping"]
    ]
    counts = ", ".join(f"{n} {pool}" for pool, n in reply["counts"].items())
    return "\n".join(lines + [f"workers now: {counts}" + ("" if lines else " (unchanged)")])


def scale_command(args) -> int:
    try:
        targets = parse_targets(args.targets)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        path = control.socket_path(args.cluster, args.control_socket)
        reply = control.call(path, {"op": "scale", "targets": targets})
        if not reply.get("ok"):
            print(f"error: {reply.get('error', 'the launcher refused')}", file=sys.stderr)
            return 1
        print(describe(reply), flush=True)
        if args.wait:
            wait_settled(path, reply, args.timeout)
            print(
                "settled: the scheduler sees the new workers, and the retired ones have exited",
                flush=True,
            )
    except (control.ControlError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def wait_settled(path, reply: dict, timeout: float, poll_s: float = POLL_S) -> None:
    """Until every started pid is in ClusterStatus and every stopped one is out of it and has exited."""
    joining = {w["pid"] for w in reply["started"]}
    leaving = {w["pid"] for w in reply["stopping"]}
    deadline = time.monotonic() + timeout
    while True:
        known = cluster_pids(reply["address"])
        retiring = {w["pid"] for w in control.call(path, {"op": "status"}).get("retiring", [])}
        pending = (joining - known) | (leaving & (known | retiring))
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"not settled within {timeout:.0f}s; still waiting for pid(s) "
                f"{sorted(pending)} (`tandem status` shows the workers the scheduler knows)"
            )
        time.sleep(poll_s)


def cluster_pids(address: str) -> set[int]:
    """The pids of the workers the scheduler knows; none while the gateway does not answer."""
    try:
        with grpc.insecure_channel(address) as channel:
            status = pb_grpc.TandemStub(channel).ClusterStatus(
                pb.ClusterStatusRequest(), timeout=STATUS_TIMEOUT_S, metadata=key_metadata()
            )
    except grpc.RpcError:
        return set()
    return {w.pid for w in status.workers}
