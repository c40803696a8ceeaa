"""`tandem`: up | generate | status | scale | bench | nats-config | api-keys."""

import argparse
import math
import os
import secrets
import sys

from shared.cli import api_keys, bench, client, launcher, scale
from shared.control import nats_auth
from shared.control.worker_roles import Mode


def seconds(text: str) -> float:
    """A time limit given as a flag: a positive number of seconds."""
    value = float(text)  # a ValueError: argparse says "invalid seconds value"
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _mode(text: str) -> Mode | str:
    """--mode as a Mode; another value is left as it is, for argparse to refuse as no choice."""
    return Mode(text) if text in tuple(Mode) else text


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    sub = top.add_subparsers(dest="command", required=True)
    _up_command(sub)
    _nats_config_command(sub)
    api_keys.add_arguments(sub)
    _generate_command(sub)
    status = sub.add_parser("status", help="the workers the scheduler knows")
    status.add_argument("--address", default="127.0.0.1:50051")
    status.add_argument(
        "--timeout",
        type=seconds,
        default=client.STATUS_TIMEOUT_S,
        help=f"seconds the gateway has to answer (default {client.STATUS_TIMEOUT_S:.0f})",
    )
    status.set_defaults(run=client.status_command)
    bench.add_arguments(
        sub.add_parser("bench", help="the serving benchmark: latency and throughput of a gateway")
    )
    _scale_command(sub)
    return top


def _up_command(sub) -> None:
    up = sub.add_parser(
        "up", help="start an embedded stack: NATS, scheduler, prefill, decode, gateway"
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    up.add_argument(
        "--decode", type=int, default=1, help="decode (or colocated) workers (default 1)"
    )
    _up_gateway_arguments(up)
    up.add_argument("--nats-url", default="", help="use this NATS server instead of starting one")
    up.add_argument(
        "--model",
        default="",
        help="HF model directory or .gguf file (default SmolLM2-135M-Instruct)",
    )
    up.add_argument(
        "--mode",
        type=_mode,
        choices=[m.value for m in Mode],
        default=Mode.AUTO,
        help="auto (default): short prompts prefilled on the decode worker, long ones on a prefill "
        "worker; disaggregated or colocated force one path",
    )
    up.add_argument("--cluster", default="default", help="cluster name (NATS subject namespace)")
    up.add_argument(
        "--model-cache",
        default=os.environ.get("TANDEM_MODEL_CACHE", "~/.cache/tandem/models"),
        help="where converted GGUF models are cached (env TANDEM_MODEL_CACHE)",
    )
    _up_start_arguments(up)
    _up_tp_arguments(up)
    _up_placement_arguments(up)
    _up_access_arguments(up)
    up.set_defaults(run=launcher.up_command)


def _up_gateway_arguments(up) -> None:
    """The gateway's ports, and how many processes serve them."""
    up.add_argument("--grpc-port", type=int, default=50051, help="gateway port (default 50051)")
    up.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the gateway's OpenAI-compatible HTTP port (default 8000; -1: none)",
    )
    up.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes sharing the gRPC and HTTP ports (SO_REUSEPORT; default 1): "
        "more where one core cannot carry the streams",
    )


def _up_start_arguments(up) -> None:
    """Where the stack's logs go, and how its start is waited for."""
    up.add_argument(
        "--log-dir", default="", help="service logs go here (default: a new temporary directory)"
    )
    up.add_argument("--no-demo", action="store_true", help="skip the demo request")
    up.add_argument(
        "--ready-timeout",
        type=seconds,
        default=launcher.READY_TIMEOUT_S,
        help="seconds the stack has to start serving with every worker joined (their models "
        f"loaded), else it stops (default {launcher.READY_TIMEOUT_S:.0f})",
    )


def _up_tp_arguments(up) -> None:
    """Each pool's tensor-parallel degree (see docs/tensor-parallel.md)."""
    up.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="tensor-parallel degree of each prefill worker: its ranks (processes), each with "
        "1/N of every layer's heads and KV and its share of the worker's cores (default 1)",
    )
    up.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="tensor-parallel degree of each decode (or colocated) worker (default 1)",
    )


def _up_placement_arguments(up) -> None:
    """Which cores each pool's workers run on (see shared/worker/placement.py)."""
    up.add_argument(
        "--prefill-cpus",
        default="",
        help="the prefill pool's cores, e.g. 0-3 (default: a share of the cores in proportion "
        "to the pools' sizes, disjoint from decode's)",
    )
    up.add_argument(
        "--decode-cpus", default="", help="the decode (or colocated) pool's cores, e.g. 4-7"
    )
    up.add_argument(
        "--prefill-devices",
        default="",
        help="GPU hosts: the prefill pool's GPU indices, e.g. 0-1 (default: a share of the GPUs "
        "in proportion to the pools' sizes; each worker its own)",
    )
    up.add_argument("--decode-devices", default="", help="the decode pool's GPU indices, e.g. 2-3")
    up.add_argument(
        "--no-pin",
        action="store_true",
        help="let every worker run on every core (prompts then take decode's cores)",
    )


def _up_access_arguments(up) -> None:
    """How `tandem scale`, the services and clients reach what `tandem up` starts."""
    up.add_argument(
        "--api-keys-file",
        default="",
        metavar="FILE",
        help="the gateway's API keys (`tandem api-keys` makes them): every request needs one; "
        "`tandem up` itself uses the first (default: none, the API on loopback only)",
    )
    up.add_argument(
        "--control-socket",
        default="",
        help="where `tandem scale` reaches this launcher "
        "(default $XDG_RUNTIME_DIR/tandem/<cluster>.sock, or ~/.cache/tandem/run/<cluster>.sock)",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        help="the default: the NATS server it starts admits one user per role, "
        "each allowed only its own subjects, with fresh passwords (files readable by you only)",
    )
    up.add_argument(
        "--insecure",
        action="store_true",
        help="start NATS without authentication (any local process may then submit, cancel or "
        "read every stream): for debugging only",
    )


def _nats_config_command(sub) -> None:
    conf = sub.add_parser(
        "nats-config", help="print a nats-server config: one user per role, limited to its subjects"
    )
    conf.add_argument(
        "--cluster", default="default", help="the cluster the services use (default: default)"
    )
    conf.add_argument(
        "--tls-dir",
        default="",
        help="NATS over TLS: the server's server.pem and server.key "
        "are in this directory (as the server sees it; deploy/make-certs.sh makes them)",
    )
    conf.add_argument(
        "--monitor-port",
        type=int,
        default=0,
        help="serve NATS monitoring on this port of the server's loopback only (its health check)",
    )
    conf.add_argument(
        "--new-env",
        default="",
        metavar="FILE",
        help="write a compose .env of fresh passwords to FILE instead, readable by you only "
        "(the config reads them from there); refuses to overwrite one",
    )
    conf.set_defaults(run=nats_config_command)


def _generate_command(sub) -> None:
    gen = sub.add_parser("generate", help="stream an answer from the gateway")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as raw text, without the chat template"
    )
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.set_defaults(run=client.generate_command)


def _scale_command(sub) -> None:
    scale_ = sub.add_parser(
        "scale", help="add or retire workers of a running `tandem up` on this machine"
    )
    scale_.add_argument(
        "targets",
        nargs="+",
        metavar="ROLE=COUNT",
        help="prefill=N and/or decode=M (decode is the colocated pool in colocated mode)",
    )
    scale_.add_argument(
        "--cluster", default="default", help="the cluster `tandem up` was started with"
    )
    scale_.add_argument(
        "--control-socket", default="", help="the launcher's socket, if `tandem up` was given one"
    )
    scale_.add_argument(
        "--wait",
        action="store_true",
        help="wait until new workers are in ClusterStatus and retired ones have exited",
    )
    scale_.add_argument(
        "--timeout", type=seconds, default=180.0, help="seconds --wait waits at most (default 180)"
    )
    scale_.set_defaults(run=scale.scale_command)


def nats_config_command(args) -> int:
    if args.new_env:
        try:
            fd = os.open(args.new_env, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            print(f"error: {args.new_env} exists; not overwriting its passwords", file=sys.stderr)
            return 1
        with os.fdopen(fd, "w") as out:
            out.write(nats_auth.env_file(nats_auth.new_passwords()))
            # and the compose stack's Grafana admin (its dashboards are open to view without)
            out.write(f"TANDEM_GRAFANA_ADMIN_PASSWORD={secrets.token_urlsafe(24)}\n")
        print(f"wrote {args.new_env} (mode 0600)", file=sys.stderr)
        return 0
    tls = (
        {"cert_file": f"{args.tls_dir}/server.pem", "key_file": f"{args.tls_dir}/server.key"}
        if args.tls_dir
        else None
    )
    print(nats_auth.server_config(args.cluster, tls=tls, monitor_port=args.monitor_port), end="")
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
