"""Role and Mode: string enums that travel, print and label exactly as the plain strings did."""

import json
import re

import msgpack
import pytest

from shared.control.messages import KVLayout, StatusReply, WorkerHeartbeat, WorkerStatus
from shared.control.wire import MessageError, decode, encode
from shared.control.worker_roles import Mode, Role

LAYOUT = KVLayout(model="m", dtype="bfloat16", num_layers=2, num_kv_heads=1, head_dim=8)


def _status(role) -> WorkerStatus:
    return WorkerStatus(worker_id="w1", role=role, host="h", pid=7)


def _old_status(role: str) -> dict:
    """A WorkerStatus as a map of plain values, in field order: what the wire carried before."""
    return {
        "worker_id": "w1",
        "role": role,
        "host": "h",
        "pid": 7,
        **dict.fromkeys(
            (
                "running",
                "queued",
                "kv_blocks_used",
                "kv_blocks_total",
                "requests_served",
                "kv_bytes_sent",
                "kv_bytes_received",
                "kv_transfers_failed",
                "kv_blocks_leaked",
                "kv_blocks_quarantined",
            ),
            0,
        ),
        **dict.fromkeys(("kv_transport", "zone"), ""),
        "messages_dropped": 0,
        **dict.fromkeys(("kernels", "model"), ""),
        "tp": 1,  # since tensor-parallel workers: a worker of one rank
        "tp_ranks": [],
    }


def _old_reply(mode: str, role: str) -> bytes:
    body = {
        "mode": mode,
        "ready": True,
        "workers": [_old_status(role)],
        "messages_dropped": 0,
        "more": False,
        "type": "StatusReply",
    }
    return msgpack.packb(body, use_bin_type=True)


def test_the_values_are_the_strings_the_wire_and_the_flags_always_used():
    assert [r.value for r in Role] == ["prefill", "decode", "colocated"]
    assert [m.value for m in Mode] == ["auto", "disaggregated", "colocated"]


@pytest.mark.parametrize("member", [*Role, *Mode], ids=str)
def test_a_member_formats_as_its_plain_value(member):
    plain = member.value
    assert str(member) == f"{member}" == format(member) == plain
    assert "%s" % member == plain  # noqa: UP031 (how log lines format it)
    assert json.dumps({"v": member}) == json.dumps({"v": plain})
    assert msgpack.packb(member) == msgpack.packb(plain)
    assert member == plain and hash(member) == hash(plain)


@pytest.mark.parametrize("mode", list(Mode), ids=str)
@pytest.mark.parametrize("role", list(Role), ids=str)
def test_role_and_mode_travel_as_before_and_come_back_as_members(mode, role):
    data = encode(StatusReply(mode=mode, ready=True, workers=[_status(role)]))
    body = msgpack.unpackb(data, raw=False)  # fields at their defaults are left out
    assert body["mode"] == mode.value and body["workers"][0]["role"] == role.value
    assert type(body["mode"]) is str and type(body["workers"][0]["role"]) is str
    reply = decode(data, StatusReply)
    assert reply.mode is mode and reply.workers[0].role is role
    # what an older peer sends (plain strings) reads the same
    assert decode(_old_reply(mode.value, role.value), StatusReply) == reply
    # a message built in-process from plain strings encodes the same bytes
    plain = StatusReply(mode=mode.value, ready=True, workers=[_status(role.value)])
    assert encode(plain) == data


@pytest.mark.parametrize("role", list(Role), ids=str)
def test_a_heartbeat_carries_its_role_as_a_member(role):
    beat = WorkerHeartbeat(
        worker_id="w1",
        role=role,
        host="h",
        pid=7,
        ucx_address=b"a",
        layout=LAYOUT,
        max_model_len=64,
    )
    data = encode(beat)
    assert msgpack.unpackb(data)["role"] == role.value
    assert decode(data, WorkerHeartbeat).role is role


@pytest.mark.parametrize(
    "mode, role, where",
    [
        ("auto", "both", "StatusReply: Invalid enum value 'both' - at `$.workers[0].role`"),
        ("auto", "Prefill", "Invalid enum value 'Prefill' - at `$.workers[0].role`"),
        ("auto", "", "Invalid enum value '' - at `$.workers[0].role`"),
        ("auto", 1, "Expected `str`, got `int` - at `$.workers[0].role`"),
        ("local", "decode", "StatusReply: Invalid enum value 'local' - at `$.mode`"),
        ("AUTO", "decode", "Invalid enum value 'AUTO' - at `$.mode`"),
        (None, "decode", "Expected `str`, got `null` - at `$.mode`"),
    ],
)
def test_an_unknown_role_or_mode_on_the_wire_is_refused(mode, role, where):
    with pytest.raises(MessageError, match=re.escape(where)):
        decode(_old_reply(mode, role), StatusReply)
