"""NATS users per role: the configs nats-server is given parse, with any password we generate."""

import re
import subprocess

from shared.cli.processes import child_env, nats_server_binary
from shared.control.nats_auth import ROLES, env_file, new_passwords, server_config


def _server_accepts(config: str, tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = tmp_path / "nats.conf"
    path.write_text(config)
    return subprocess.run(
        [nats_server_binary(), "-t", "-c", str(path)],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_new_passwords_are_strings_to_nats_server(tmp_path):
    """nats-server reads a $VARIABLE's value as a config token: a password starting with a digit
    became a number and the server refused to start (seen once in CI)."""
    for _ in range(200):
        passwords = new_passwords()
        assert set(passwords) == set(ROLES) and len(set(passwords.values())) == len(ROLES)
        assert all(re.fullmatch(r"[a-z][0-9a-f]{48}", pw) for pw in passwords.values())
    for _ in range(5):  # the compose way: the config names variables, the .env gives them
        dotenv = dict(line.split("=", 1) for line in env_file(new_passwords()).splitlines())
        done = _server_accepts(server_config("default"), tmp_path, dotenv)
        assert done.returncode == 0, done.stdout + done.stderr


def test_literal_passwords_and_tls_parse(tmp_path):
    """The `tandem up --secure` way: the passwords written into the config."""
    config = server_config("c", new_passwords())
    done = _server_accepts(config, tmp_path, {})
    assert done.returncode == 0, done.stdout + done.stderr
    tls = server_config(
        "c", new_passwords(), tls={"cert_file": "/x/server.pem", "key_file": "/x/server.key"}
    )
    assert 'cert_file: "/x/server.pem"' in tls and 'key_file: "/x/server.key"' in tls
