"""Security switched on: NATS with one user per role (each allowed only its subjects) over TLS, and
the gRPC API over TLS with client certificates. Strangers and other roles are refused; the stack
serves; no secret reaches a log.
"""

import asyncio
import time
from pathlib import Path

import grpc
import nats
import pytest

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.cli.processes import child_env, free_port, nats_server_binary, wait_for_port
from shared.control.nats_auth import ROLES, new_passwords, server_config
from shared.control.subjects import Subjects
from shared.settings import CommonSettings, nats_options
from tests.integration.certs import make_certs
from tests.integration.helpers import chat_request, long_document
from tests.integration.stack import NatsServer, start_stack, wait_serving

pytestmark = pytest.mark.slow
CLUSTER = "it-sec"


def _tls(certs: dict, client: bool = True):
    settings = CommonSettings(
        nats_tls_ca=certs["ca.pem"],
        nats_tls_cert=certs["client.pem"] if client else "",
        nats_tls_key=certs["client.key"] if client else "",
    )
    return nats_options(settings)["tls"]


async def _connect(url: str, errors: list, **options):
    async def on_error(err):
        errors.append(str(err))

    return await nats.connect(
        url,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        connect_timeout=3,
        error_cb=on_error,
        **options,
    )


async def _strangers_and_other_roles(url: str, certs: dict, passwords: dict) -> None:
    s = Subjects(CLUSTER)
    for options in (
        {"tls": _tls(certs)},  # no credentials
        {"tls": _tls(certs), "user": "tandem-gateway", "password": "guess"},  # wrong password
        {"user": "tandem-gateway", "password": passwords["gateway"]},
    ):  # no TLS
        with pytest.raises(Exception):  # noqa: B017 (refusals surface as several nats-py errors)
            client = await _connect(url, [], **options)
            await client.close()
    errors: list[str] = []
    scheduler = await _connect(
        url, [], tls=_tls(certs), user="tandem-scheduler", password=passwords["scheduler"]
    )
    prefill = await _connect(
        url, errors, tls=_tls(certs), user="tandem-prefill", password=passwords["prefill"]
    )
    try:
        got = []

        async def on_submit(msg):
            got.append(msg.data)

        await scheduler.subscribe(s.submit, cb=on_submit)
        await scheduler.flush()
        await prefill.publish(s.submit, b"forged request")  # a prefill worker may not submit
        # nor read anyone's token stream
        await prefill.subscribe(s.gateway_tokens("gw"), cb=on_submit)
        # nor the decode workers' prompts
        await prefill.subscribe(s.decode_tasks("d"), cb=on_submit)
        await prefill.flush()
        decode_errors: list[str] = []
        decode = await _connect(
            url, decode_errors, tls=_tls(certs), user="tandem-decode", password=passwords["decode"]
        )
        listener = await _connect(
            url, [], tls=_tls(certs), user="tandem-decode", password=passwords["decode"]
        )
        # a decode worker's own assignments
        await listener.subscribe(s.decode_tasks("d"), cb=on_submit)
        await listener.flush()
        # a decode worker may not assign work
        await decode.publish(s.decode_tasks("d"), b"forged assignment")
        await decode.flush()
        await asyncio.sleep(0.5)
        assert got == []
        await scheduler.publish(s.decode_tasks("d"), b"assignment")  # the scheduler may
        await scheduler.flush()
        await asyncio.sleep(0.5)
        await decode.close()
        await listener.close()
        assert got == [b"assignment"]
        assert sum("permissions violation" in e.lower() for e in errors) >= 3, errors
        assert any("permissions violation" in e.lower() for e in decode_errors), decode_errors
    finally:
        await scheduler.close()
        await prefill.close()


def test_secure_stack_refuses_strangers_and_serves_with_auth_and_tls(processes, tmp_path):
    certs = make_certs(tmp_path)
    passwords = new_passwords()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        server_config(
            CLUSTER,
            passwords,
            tls={"cert_file": certs["server.pem"], "key_file": certs["server.key"]},
        )
    )
    conf.chmod(0o600)
    port, monitor = free_port(), free_port()
    processes.spawn(
        "nats-secure",
        [
            nats_server_binary(),
            "-c",
            str(conf),
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "-m",
            str(monitor),
        ],
        child_env({}),
    )
    assert wait_for_port("127.0.0.1", port, 15), processes.log_tail("nats-secure")
    url = f"tls://127.0.0.1:{port}"
    asyncio.run(_strangers_and_other_roles(url, certs, passwords))

    role_env = {}
    for role in ROLES:
        secret = tmp_path / f"{role}.password"
        secret.write_text(passwords[role] + "\n")
        secret.chmod(0o600)
        role_env[role] = {
            "TANDEM_NATS_USER": f"tandem-{role}",
            "TANDEM_NATS_PASSWORD_FILE": str(secret),
        }
    role_env["gateway"].update(
        TANDEM_GRPC_TLS_CERT=certs["server.pem"],
        TANDEM_GRPC_TLS_KEY=certs["server.key"],
        TANDEM_GRPC_TLS_CLIENT_CA=certs["ca.pem"],
    )
    stack = start_stack(
        processes,
        NatsServer(url, monitor),
        CLUSTER,
        "auto",
        wait=False,
        role_env=role_env,
        extra_env={"TANDEM_NATS_TLS_CA": certs["ca.pem"], "TANDEM_LOCAL_PREFILL_TOKENS": "64"},
    )
    try:
        read = lambda name: Path(certs[name]).read_bytes()  # noqa: E731
        trusted = grpc.ssl_channel_credentials(
            read("ca.pem"), read("client.key"), read("client.pem")
        )
        wait_serving(stack.address, stack.group, names=stack.names, credentials=trusted)
        with grpc.secure_channel(stack.address, trusted) as channel:
            api = pb_grpc.TandemStub(channel)
            deadline = time.monotonic() + 240
            while (
                len(api.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).workers) < 2
            ):  # the prefill one too
                assert not stack.dead() and time.monotonic() < deadline, stack.dead()
                time.sleep(0.2)
            responses = list(api.Generate(chat_request(long_document(300), 4), timeout=120))
        assert (
            responses[-1].finish_reason and responses[-1].timing.path == "disaggregated"
        )  # KV moved, all roles spoke

        with pytest.raises(grpc.RpcError):  # plaintext: refused
            list(stack.stub().Generate(chat_request("hi", 2), timeout=10))
        no_client_cert = grpc.ssl_channel_credentials(read("ca.pem"))
        with (
            grpc.secure_channel(stack.address, no_client_cert) as channel,
            pytest.raises(grpc.RpcError),
        ):
            list(pb_grpc.TandemStub(channel).Generate(chat_request("hi", 2), timeout=10))
    finally:
        stack.stop()
    logs = {
        name: (processes.log_dir / f"{name}.log").read_text(errors="replace")
        for name in stack.names
    }
    leaked = [
        (name, role) for name, text in logs.items() for role, pw in passwords.items() if pw in text
    ]
    assert not leaked, f"a password reached a log: {leaked}"
