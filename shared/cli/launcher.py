"""`tandem up`: NATS (unless given), one scheduler, prefill and decode workers and the gateway, as processes.

While it runs, `tandem scale` reaches it on its control socket to add or retire workers, and it
restarts whatever crashes: a worker is replaced (its requests have moved), NATS, the scheduler and
the gateway start again as they were (the others reconnect by themselves). A crash loop stops it.
"""

import signal
import sys
import tempfile
from pathlib import Path

import grpc

from shared import model_store
from shared.cli.api_keys import KeysFileError, first_key
from shared.cli.client import key_metadata, stream_generate, summary, wait_until_serving
from shared.cli.control import ControlError, ControlServer, socket_path
from shared.cli.pools import (
    Restarts,
    ScaleError,
    WorkerPools,
    devices_of,
    placement_of,
    sharing_notes,
    tp_degrees,
    worker_specs,
)
from shared.cli.processes import (
    ProcessGroup,
    child_env,
    free_port,
    nats_server_binary,
    wait_for_port,
)
from shared.control.nats_auth import ROLES, write_credentials
from shared.control.worker_roles import Mode
from shared.engine.architecture import UnsupportedModel, check
from shared.worker.tp_group import TPError, split_of

DEMO_PROMPT = "In one sentence, why does separating prefill from decode help LLM serving?"
READY_TIMEOUT_S = 300.0  # `tandem up`'s default --ready-timeout
POLL_S = 0.3  # how often the launcher looks: at its children, its socket
NATS_START_TIMEOUT_S = 15.0
SERVICES = ("nats", "scheduler", "gateway")  # restarted in place when one crashes


def start_stack(args, group: ProcessGroup, secrets_dir: Path | None = None) -> WorkerPools:
    """Starts every process; returns the worker pools (which know the gateway address). With
    `secrets_dir` the NATS server it starts admits one user per role, each limited to its subjects."""
    config, role_env = [], {role: {} for role in ROLES}
    if secrets_dir is not None:
        conf, role_env = write_credentials(secrets_dir, args.cluster)
        config = ["-c", str(conf)]
    common = {
        "TANDEM_NATS_URL": args.nats_url or _start_nats(group, config),
        "TANDEM_CLUSTER": args.cluster,
        "TANDEM_MODEL": args.model,
        "TANDEM_MODEL_CACHE": args.model_cache,
    }
    python = [sys.executable, "-m"]
    group.spawn(
        "scheduler",
        python + ["services.scheduler"],
        child_env({**common, "TANDEM_MODE": args.mode, **role_env["scheduler"]}),
    )
    pools = WorkerPools(
        group,
        args.mode,
        worker_specs(args, common, role_env),
        f"127.0.0.1:{args.grpc_port}",
        placement=placement_of(args),
        devices=devices_of(args),
    )
    if args.mode != Mode.COLOCATED:
        pools.resize("prefill", args.prefill)
    pools.resize("decode", args.decode)
    ports = {"TANDEM_GRPC_PORT": str(args.grpc_port), "TANDEM_HTTP_PORT": str(args.http_port)}
    if args.api_keys_file:  # absolute: the gateway, restarted, reads it again from anywhere
        ports["TANDEM_API_KEYS_FILE"] = str(Path(args.api_keys_file).resolve())
    if args.gateways > 1:  # one port, the kernel spreading connections across them
        ports["TANDEM_REUSE_PORT"] = "1"
    for name in (f"gateway-{i}" if i else "gateway" for i in range(args.gateways)):
        group.spawn(
            name,
            python + ["services.gateway"],
            child_env({**common, **ports, **role_env["gateway"]}),
        )
    return pools


def restarted_in_place(name: str) -> bool:
    """A service restarted where it crashed: NATS, the scheduler, each gateway process."""
    return name in SERVICES or name.startswith("gateway-")


def _start_nats(group: ProcessGroup, config: list[str]) -> str:
    """A NATS server of the stack's own on free loopback ports; its URL."""
    port, monitor = free_port(), free_port()
    group.spawn(
        "nats",
        [nats_server_binary(), *config, "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)],
        child_env({}),
    )
    if not wait_for_port("127.0.0.1", port, NATS_START_TIMEOUT_S):
        raise RuntimeError("nats-server did not start:\n" + group.log_tail("nats"))
    return f"nats://127.0.0.1:{port}"


class Signals:
    """SIGINT/SIGTERM seen by `tandem up`: while the stack is still starting, the first one unwinds
    the start (the ProcessGroup stops what runs); once it serves, the serving loop sees them."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.serving = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        first = not self.received
        self.received.append(signum)
        if first and not self.serving:
            raise KeyboardInterrupt


def _refusal(args) -> str:
    """Why these arguments cannot start a stack ("" when they can)."""
    if args.prefill < 1 or args.decode < 1:
        return "--prefill and --decode must be at least 1"
    if args.gateways < 1:
        return "--gateways must be at least 1"
    if args.prefill_tp < 1 or args.decode_tp < 1:
        return "--prefill-tp and --decode-tp must be at least 1"
    if args.mode == Mode.COLOCATED and args.prefill_tp > 1:
        return "a colocated stack has no prefill workers: give its workers --decode-tp"
    if args.secure and args.nats_url:
        return (
            "--secure starts a NATS server of its own; for yours, give each service its "
            "credentials (TANDEM_NATS_USER, TANDEM_NATS_PASSWORD_FILE; see docs/security.md)"
        )
    if args.secure and args.insecure:
        return "--secure and --insecure contradict each other"
    if args.api_keys_file:
        try:
            first_key(args.api_keys_file)
        except KeysFileError as wrong:  # unreadable, not a keys file, or no key in it
            return f"--api-keys-file: {wrong}"
    try:
        placement_of(args), devices_of(args)
    except ValueError as wrong:  # a --prefill-cpus/--decode-cpus/--*-devices list
        return str(wrong)
    return ""


def secured(args) -> bool:
    """NATS authentication is on unless --insecure says otherwise (or NATS is the user's own)."""
    if args.insecure:
        warning = "NATS without authentication; any local process may submit, cancel or read"
        print(f"warning: --insecure: {warning} every stream", file=sys.stderr, flush=True)
    return not args.insecure and not args.nats_url


def up_command(args) -> int:
    if refusal := _refusal(args):
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    signals = Signals()
    try:
        # Bound first: a second launcher of the same cluster is refused before it starts anything.
        with ControlServer(socket_path(args.cluster, args.control_socket)) as control:
            print("preparing the model (the first run converts the GGUF once) ...", flush=True)
            # an architecture or option the engine does not run: refused before anything starts
            config = model_store.load_config(model_store.prepare(args.model, args.model_cache))
            check(config)
            for tp in tp_degrees(args).values():  # refused here, not by workers crash-looping
                split_of(config, tp)
            for note in sharing_notes(args):
                print(f"note: {note}", flush=True)
            with (
                tempfile.TemporaryDirectory(prefix="tandem-secrets-") as secrets,
                ProcessGroup(log_dir) as group,
            ):
                secrets_dir = Path(secrets) if secured(args) else None
                return _serve(args, group, control, log_dir, signals, secrets_dir)
    except (ControlError, UnsupportedModel, TPError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1 if isinstance(err, ControlError) else 2
    except KeyboardInterrupt:
        print("interrupted; every process stopped.", flush=True)
        return 130


def _serve(
    args,
    group: ProcessGroup,
    control: ControlServer,
    log_dir: Path,
    signals: Signals,
    secrets_dir: Path | None,
) -> int:
    try:
        pools = start_stack(args, group, secrets_dir)
        print(f"starting {args.mode} stack, logs in {log_dir} ...", flush=True)
        workers = args.decode + (args.prefill if args.mode != Mode.COLOCATED else 0)
        # the launcher's own calls: the first key's, when the gateway requires keys
        metadata = key_metadata(first_key(args.api_keys_file) if args.api_keys_file else "")
        wait_until_serving(pools.address, group, args.ready_timeout, workers, metadata)
    except (RuntimeError, TimeoutError, KeysFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    _announce(args, pools.address, control, secure=secrets_dir is not None)
    if not args.no_demo:
        _demo(pools.address, metadata)
    signals.serving = True
    if not _run_until_stopped(group, control, pools, signals.received):
        return 1
    print("stopping ...", flush=True)
    group.stop()
    print("stopped.", flush=True)
    return 0


def _announce(args, address: str, control: ControlServer, secure: bool) -> None:
    tp = {pool: f" (tp {d})" if d > 1 else "" for pool, d in tp_degrees(args).items()}
    sizes = (
        f"{args.prefill} prefill{tp['prefill']}, {args.decode} decode{tp['decode']}"
        if args.mode != Mode.COLOCATED
        else f"{args.decode} colocated{tp['decode']}"
    )
    http = f", OpenAI API on http://127.0.0.1:{args.http_port}/v1" if args.http_port >= 0 else ""
    placement, devices = placement_of(args), devices_of(args)
    cores = f"; {placement.describe()}" if placement else "; every worker on every core"
    cores += f"; {devices.describe('GPUs')}" if devices else ""
    print(
        f"tandem is ready: gRPC API on {address}{http} ({args.mode}; {sizes}{cores}"
        + ("; NATS: one user per role" if secure else "")
        + (f"; API keys from {args.api_keys_file}" if args.api_keys_file else "")
        + "). Ctrl-C stops it.",
        flush=True,
    )
    print(
        f"control socket {control.path}: `tandem scale decode=N` adds or retires workers",
        flush=True,
    )


def _demo(address: str, metadata: tuple) -> None:
    print(f"demo> {DEMO_PROMPT}", flush=True)
    try:
        last = stream_generate(address, DEMO_PROMPT, 64, 0.0, metadata=metadata)
        print(summary(last), flush=True)
    except grpc.RpcError as err:
        print(f"demo request failed: {err.code().name}: {err.details()}", file=sys.stderr)


def _run_until_stopped(
    group: ProcessGroup, control: ControlServer, pools: WorkerPools, stopping: list
) -> bool:
    """Serves `tandem scale` until a signal (True) or a crash loop (False); retired workers may
    exit, a crashed worker is replaced, a crashed NATS, scheduler or gateway restarted."""
    restarts = Restarts()
    while not stopping:
        dead = dict(group.dead())  # one look: a worker exiting after it is not taken for a service
        try:
            for name, code, new in pools.replace_crashed(dead):
                print(
                    f"{name} exited with code {code}; started {new} in its place:\n{group.log_tail(name, 5)}",
                    file=sys.stderr,
                    flush=True,
                )
                del dead[name]
        except ScaleError as err:
            print(f"error: {err}; stopping the stack", file=sys.stderr)
            return False
        for name, code in dead.items():
            if not restarted_in_place(name) or not restarts.allow(name):
                print(
                    f"error: {name} exited with code {code}"
                    + (", again" if restarted_in_place(name) else "")
                    + f"; stopping the stack:\n{group.log_tail(name)}",
                    file=sys.stderr,
                )
                return False
            print(
                f"{name} exited with code {code}; restarting it:\n{group.log_tail(name, 5)}",
                file=sys.stderr,
                flush=True,
            )
            group.restart(name)
        for name, code, killed in group.reap():
            how = "killed: it did not drain in time" if killed else f"exit code {code}"
            print(f"retired {name} is gone ({how})", flush=True)
        control.poll(pools, timeout=POLL_S)
    return True
