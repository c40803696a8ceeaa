"""NATS users per role, each allowed only the subjects its service needs, and the server config that says so.

A foreign client without credentials cannot connect; a client with one role's credentials cannot
publish what another role publishes (a prefill worker's password does not let anyone submit
requests or forge token streams). Answers to requests go back on the asker's inbox: responders get
`allow_responses` (they may answer what they were asked, nothing else on _INBOX), and askers read
only their own role's inboxes (_INBOX.<role>.>).

`tandem nats-config` prints a config for a cluster (passwords as $VARIABLES the server reads from
its environment, or literal ones); `tandem up --secure` writes one with fresh passwords.
"""

import json
import os
import secrets
from pathlib import Path

from shared.control.subjects import Subjects

ROLES = ("gateway", "scheduler", "prefill", "decode")


def inbox_prefix(role: str) -> str:
    """Where `role`'s requests ask for their answers (NatsBus(role=...) uses it)."""
    return f"_INBOX.{role}"


def inbox(role: str) -> str:
    """The reply inboxes of `role`'s requests: what its NATS user may subscribe to."""
    return inbox_prefix(role) + ".>"


def permissions(role: str, cluster: str) -> dict:
    """{'publish': [...], 'subscribe': [...]} for `role`; worker and gateway ids are not known in
    advance, so their subjects are matched by wildcard (`*`) within the cluster."""
    subjects = Subjects(cluster)
    publish, subscribe = _ROLE_SUBJECTS[role](subjects)
    return {"publish": [*publish, subjects.probe], "subscribe": subscribe}


def _gateway(s: Subjects) -> tuple[list[str], list[str]]:
    publish = [s.submit, s.status, s.cancel, s.ping("*"), s.stream_replay("*")]
    publish += [s.submit_to("*"), s.scheduler_ping("*"), s.gateway_holdings]
    publish.append(s.decode_tasks("*"))  # a request placed in a room a scheduler named
    subscribe = [s.gateway_tokens("*"), s.heartbeat, s.scheduler_heartbeat, s.gateway_holdings]
    return publish, subscribe + [inbox("gateway")]


def _scheduler(s: Subjects) -> tuple[list[str], list[str]]:
    publish = [s.discover, s.decode_tasks("*"), s.cancel, s.scheduler_heartbeat]
    subscribe = [s.submit, s.status, s.heartbeat, s.cancel, inbox("scheduler")]
    return publish, subscribe + [s.submit_to("*"), s.scheduler_ping("*")]


def _prefill(s: Subjects) -> tuple[list[str], list[str]]:
    publish = [s.heartbeat, s.prefill_results("*")]
    subscribe = [s.prefill_tasks("*"), s.transfer_aborts("*"), s.cancel, s.discover, s.ping("*")]
    return publish, subscribe


def _decode(s: Subjects) -> tuple[list[str], list[str]]:
    publish = [s.heartbeat, s.prefill_tasks("*"), s.transfer_aborts("*"), s.gateway_tokens("*")]
    publish.append(s.ping("*"))
    subscribe = [s.decode_tasks("*"), s.prefill_results("*"), s.cancel, s.discover, s.heartbeat]
    subscribe += [s.ping("*"), s.stream_replay("*"), inbox("decode")]
    return publish, subscribe


_ROLE_SUBJECTS = {
    "gateway": _gateway,
    "scheduler": _scheduler,
    "prefill": _prefill,
    "decode": _decode,
}


def new_passwords() -> dict[str, str]:
    """A fresh password per role: a letter, then 48 hex digits (192 random bits). nats-server reads
    a $VARIABLE's value as a config token, so it must not look like a number (or hold quotes)."""
    return {role: "t" + secrets.token_hex(24) for role in ROLES}


# A client or route that went silent (its host cut off, or frozen) is given up within
# ping_interval x (ping_max + 1), ~6 s, and its subscriptions with it. With nats-server's default
# (a ping every 2 minutes) a worker cut off that way kept its share of a queue group's messages,
# into the void, for minutes (seen with a scheduler: ClusterStatus "no scheduler answered").
SILENCE = [
    "# A silent client is given up within ~6 s (nats-server's default: minutes).",
    'ping_interval: "2s"',
    "ping_max: 2",
]


def server_config(
    cluster: str,
    passwords: dict[str, str] | None = None,
    tls: dict | None = None,
    monitor_port: int = 0,
) -> str:
    """A nats-server config: one user per role (`tandem-<role>`) with its permissions. Without
    `passwords`, each is read from the server's environment ($TANDEM_NATS_<ROLE>_PASSWORD).
    `tls`: {'cert_file', 'key_file', optional 'ca_file' (then clients must show a certificate)}.
    `monitor_port`: the monitoring endpoint, on the server's loopback only (a health check)."""
    users = []
    for role in ROLES:
        password = (
            json.dumps(passwords[role]) if passwords else f"$TANDEM_NATS_{role.upper()}_PASSWORD"
        )
        allowed = permissions(role, cluster)
        users.append(
            f"    {{user: {json.dumps('tandem-' + role)}, password: {password}, permissions: {{"
            f"publish: {json.dumps(allowed['publish'])}, subscribe: {json.dumps(allowed['subscribe'])}, "
            f"allow_responses: true}}}}"
        )
    lines = [
        "# Tandem: one NATS user per role, each allowed only its own subjects (shared/control/nats_auth.py).",
        "authorization {",
        "  users = [",
        *users,
        "  ]",
        "}",
        *SILENCE,
    ]
    if tls:
        lines += [
            "tls {",
            f"  cert_file: {json.dumps(tls['cert_file'])}",
            f"  key_file: {json.dumps(tls['key_file'])}",
        ]
        if tls.get("ca_file"):
            lines += [f"  ca_file: {json.dumps(tls['ca_file'])}", "  verify: true"]
        lines += ["}"]
    if monitor_port:
        lines += [f'http: "127.0.0.1:{monitor_port}"']
    return "\n".join(lines) + "\n"


def write_credentials(directory: Path, cluster: str) -> tuple[Path, dict[str, dict[str, str]]]:
    """Fresh passwords for every role, in files only their owner may read: the server config, and
    each role's settings (TANDEM_NATS_USER, TANDEM_NATS_PASSWORD_FILE) to start its services with."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    passwords = new_passwords()
    config = _private(directory / "nats.conf", server_config(cluster, passwords))
    # A password or token in the launcher's own environment must not win over the role's file.
    role_env = {
        role: {
            "TANDEM_NATS_USER": f"tandem-{role}",
            "TANDEM_NATS_PASSWORD": "",
            "TANDEM_NATS_TOKEN": "",
            "TANDEM_NATS_TOKEN_FILE": "",
            "TANDEM_NATS_PASSWORD_FILE": str(
                _private(directory / f"{role}.password", passwords[role])
            ),
        }
        for role in ROLES
    }
    return config, role_env


def env_file(passwords: dict[str, str]) -> str:
    """A compose .env with each role's password (what compose.yaml and deploy/nats.conf read)."""
    return "".join(f"TANDEM_NATS_{role.upper()}_PASSWORD={passwords[role]}\n" for role in ROLES)


def _private(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path
