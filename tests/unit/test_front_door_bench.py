"""bench/front_door's hostile bodies are what issue 45 describes (each under the 1 MiB cap, so the
gateway must parse them), and its verdicts fail what they should."""

import argparse
import asyncio
import json

import pytest

from bench.front_door_attacks import (
    MIB,
    deep_bodies,
    empty_messages_body,
    huge_text_body,
    tiny_messages_body,
)
from bench.front_door_report import half_open_summary, verdicts
from bench.half_open import half_open


def test_the_message_flood_is_36000_empty_messages_under_one_mib():
    body = empty_messages_body("m", 36000)
    assert len(body) < MIB
    messages = json.loads(body)["messages"]
    assert len(messages) == 36000 and messages[0] == {"role": "user", "content": ""}


def test_the_big_bodies_fill_one_mib_without_passing_it():
    tiny = tiny_messages_body("m", 4000)
    huge = huge_text_body("m")
    assert MIB - 8192 < len(tiny) < MIB and MIB - 8192 < len(huge) < MIB
    assert len(json.loads(tiny)["messages"]) == 4000
    assert len(json.loads(huge)["messages"]) == 4


def test_the_deep_bodies_are_too_deep_for_a_recursive_parser():
    bodies = deep_bodies("m")
    with pytest.raises(RecursionError):
        json.loads(bodies["deep_content"])
    assert bodies["open_brackets"] == b"[" * 100_000


ARGS = argparse.Namespace(stall_timeout_s=30.0, close_grace_s=5.0)


def connection(how: str, held_s: float) -> dict:
    closed = None if how == "open" else held_s
    return {"kind": "headers", "how": how, "answer": "", "closed_after_s": closed, "held_s": held_s}


def test_a_connection_still_open_past_the_timeout_fails_the_bar():
    conns = [connection("eof", 30.2), connection("open", 50.0)]
    summary = half_open_summary(conns, ARGS)
    assert summary["closed_by_gateway"] == 1 and summary["open_at_end"] == 1
    assert summary["longest_held_s"] == 50.0 > summary["bar_s"]


def phase(ttft_p99: float, itl_p99: float, rss: float, **attack) -> dict:
    return {
        "requests": 10,
        "failures": {},
        "ttft_ms": {"p50": ttft_p99, "p99": ttft_p99},
        "itl_ms": {"p50": itl_p99, "p99": itl_p99},
        "rss_mib": [(0.0, 400.0), (1.0, rss)],
        "attack": {"deep_json": {"open_brackets": "400"}, **attack},
    }


def test_verdicts_hold_the_attack_phases_to_twice_the_unloaded_p99():
    out = {
        "gateway_pids": [1],
        "phases": {
            "unloaded": phase(100, 30, 400),
            "message_flood": phase(150, 90, 500),
        },
    }
    bars = verdicts(out, ARGS)
    assert bars["message_flood: TTFT p99 ratio"]["pass"]
    assert not bars["message_flood: ITL p99 ratio"]["pass"]  # 3x
    assert bars["gateway RSS growth under attack (MiB)"]["pass"]  # +100 MiB
    out["phases"]["message_flood"]["rss_mib"].append((2.0, 700.0))
    out["gateway_pids"].append(2)
    bars = verdicts(out, ARGS)
    assert not bars["gateway RSS growth under attack (MiB)"]["pass"]
    assert not bars["gateway restarts"]["pass"]


async def test_half_open_records_when_and_how_a_server_closes_stalled_connections():
    """A server that answers 408 and closes 0.3 s after the first bytes; the attacker's sockets
    come from 127.0.0.2, each replaced once closed."""
    peers = set()

    async def timeout_after(reader, writer):
        peers.add(writer.get_extra_info("peername")[0])
        await reader.read(1024)
        await asyncio.sleep(0.3)
        writer.write(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(timeout_after, "127.0.0.1", 0)
    config = {"host": "127.0.0.1", "port": server.sockets[0].getsockname()[1]}
    config |= {"source": "127.0.0.2", "count": 4, "connect_timeout_s": 5.0}
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(1.0, stop.set)
    async with server:
        conns = (await half_open(config, stop))["connections"]
    closed = [c for c in conns if c["closed_after_s"] is not None]
    assert peers == {"127.0.0.2"} and len(closed) >= 4
    assert {c["answer"] for c in closed} == {"HTTP/1.1 408 Request Timeout"}
    assert all(0.25 < c["closed_after_s"] < 0.9 for c in closed)
    assert {c["kind"] for c in conns} == {"headers", "body"}
