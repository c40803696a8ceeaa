"""`tandem api-keys`: the gateway's keys file (--api-keys-file), made and added to here.

The file is what services/gateway/clients.py reads: {"clients": [{"name": ..., "key": ...}, ...]},
each entry optionally with its own limits (max_priority, max_streams, max_queued, max_kv_tokens).
A new key is 256 random bits (secrets.token_urlsafe), printed once, on stdout, and kept nowhere
else. The file is written whole and then renamed over the old one, readable by its owner only (a
file that was group-readable, as compose's, stays so; no one else may read it either way).
"""

import json
import os
import re
import secrets
import sys
import tempfile
from pathlib import Path

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a client's name: in logs and metric labels
KEY_BYTES = 32


class KeysFileError(ValueError):
    """The keys file cannot be read or written as asked; the message is for the user."""


def read_clients(path: Path) -> list[dict]:
    """The entries of the keys file at `path` (none when it does not exist)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except OSError as err:
        raise KeysFileError(f"cannot read {path}: {err.strerror}") from None
    except ValueError as err:
        raise KeysFileError(f"{path} is not JSON: {err}") from None
    clients = doc.get("clients") if isinstance(doc, dict) else None
    if not isinstance(clients, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("key"), str)
        for c in clients
    ):
        raise KeysFileError(f'{path}: expected {{"clients": [{{"name": ..., "key": ...}}, ...]}}')
    return clients


def add_key(path: Path, name: str) -> str:
    """Adds a client `name` with a new key to the file at `path` (made if missing); the key."""
    if not NAME_RE.fullmatch(name):
        raise KeysFileError(f"a client's name is 1-64 of A-Z a-z 0-9 _ . -, not {name!r}")
    clients = read_clients(path)
    if any(c["name"] == name for c in clients):
        raise KeysFileError(f"{path} has a client {name!r} already; choose another name")
    key = secrets.token_urlsafe(KEY_BYTES)
    _write(path, {"clients": [*clients, {"name": name, "key": key}]})
    return key


def _write(path: Path, doc: dict) -> None:
    """Whole, then renamed into place: a gateway reading it meanwhile sees the old file or the new."""
    try:
        mode = path.stat().st_mode & 0o740  # never more than its owner's and group's reading
    except FileNotFoundError:
        mode = 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(doc, out, indent=2)
            out.write("\n")
        os.chmod(tmp, mode | 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def first_key(path: str) -> str:
    """The first key of a keys file: the one `tandem up` itself uses (its wait, its demo)."""
    clients = read_clients(Path(path))
    if not clients:
        raise KeysFileError(f"{path} has no keys: `tandem api-keys --new {path} --name NAME`")
    return clients[0]["key"]


def add_arguments(sub) -> None:
    keys = sub.add_parser(
        "api-keys", help="make a key for the gateway's --api-keys-file (prints it once)"
    )
    keys.add_argument(
        "--new",
        required=True,
        metavar="FILE",
        help="the keys file to add to (made, readable by you only, when missing)",
    )
    keys.add_argument(
        "--name",
        required=True,
        help="the client's name: what logs, metrics and its limits know it by",
    )
    keys.set_defaults(run=api_keys_command)


def api_keys_command(args) -> int:
    path = Path(args.new)
    try:
        key = add_key(path, args.name)
    except (KeysFileError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(key)
    print(
        f"added {args.name!r} to {path}; its key (printed on stdout) is not shown again "
        f"(clients send it as `Authorization: Bearer <key>`)",
        file=sys.stderr,
    )
    return 0
