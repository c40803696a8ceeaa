"""NATS users per role: the configs nats-server is given parse, with any password we generate."""

import json
import re
import socket
import subprocess
import time

from shared.cli.processes import child_env, free_port, nats_server_binary, wait_for_port
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


def test_the_server_gives_up_a_silent_client_within_seconds(tmp_path):
    """A client that stops answering (its host cut off) is dropped, and its subscriptions with
    it, in ~6 s, not nats-server's default of minutes: here one that never answers a PING."""
    passwords = new_passwords()
    port = free_port()
    path = tmp_path / "nats.conf"
    path.write_text(server_config("default", passwords))
    server = subprocess.Popen(
        [nats_server_binary(), "-c", str(path), "-a", "127.0.0.1", "-p", str(port)],
        env=child_env({}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_for_port("127.0.0.1", port, 10)
        with socket.create_connection(("127.0.0.1", port), timeout=15) as client:
            assert client.recv(4096).startswith(b"INFO")
            hello = {"user": "tandem-gateway", "pass": passwords["gateway"], "verbose": False}
            client.sendall(b"CONNECT " + json.dumps(hello).encode() + b"\r\nPING\r\n")
            started, heard = time.monotonic(), b""
            while chunk := client.recv(4096):  # the server's PONG, its PINGs, then the close
                heard += chunk
            silent_s = time.monotonic() - started
        assert b"PONG" in heard and heard.count(b"PING") >= 2  # logged in, then asked twice
        assert 3 < silent_s < 12, silent_s
    finally:
        server.terminate()
        server.wait(timeout=10)
