"""The KV data plane between two real processes over real UCX, with UCX in a data-plane helper
process of each (the workers' default) and in-process: the blocks arrive bit for bit through
either connector (push: a message per run of decode blocks; staged: a message per segment,
gathered and scattered), only the missing suffix moves, a stalled transfer is released, a
restarted peer is reached, and a crash inside UCX costs only the transfers in flight."""

import os
import random
import signal
import time

import pytest

from harness.kv_peer import KVPeer
from shared.control.messages import KVLayout
from shared.kvtransfer.plan import new_base_tag

pytestmark = pytest.mark.slow

BS = 16
LAYOUT = KVLayout(
    model="m", dtype="float32", num_layers=30, num_kv_heads=3, head_dim=64, block_size=BS
)


@pytest.fixture(scope="module", params=[True, False], ids=["helper", "inprocess"])
def helper(request) -> bool:
    """Each test with UCX in a data-plane helper process (the workers' default) and in-process."""
    return request.param


@pytest.fixture(scope="module")
def prefill(helper):
    with KVPeer(LAYOUT, num_blocks=160, seed=1, helper=helper) as peer:
        yield peer


@pytest.fixture()
def decode(helper):
    with KVPeer(LAYOUT, num_blocks=192, helper=helper) as peer:
        yield peer


def destination(
    address: bytes, block_ids: list[int], skip: int = 0, segment: int = 256, how: str = "push"
) -> dict:
    return dict(
        ucx_address=address,
        base_tag=new_base_tag(random.getrandbits(39)),
        block_ids=block_ids,
        skip_tokens=skip,
        segment_tokens=segment,
        lease_s=5.0,
        connector=how,
    )


def wait_for_first_piece(decode: KVPeer, dest: dict, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not decode.call("wait", base_tag=dest["base_tag"], timeout_s=0.05)["landed"]:
        assert time.monotonic() < deadline, "no KV piece landed"


def tables(prompt_len: int, rng: random.Random) -> tuple[list[int], list[int]]:
    n = -(-prompt_len // BS)
    src = rng.sample(range(160), n)
    # one run, then scattered
    dst = list(range(64, 64 + n // 2)) + rng.sample(range(0, 64), n - n // 2)
    return src, dst


@pytest.mark.parametrize("how", ["push", "staged"])
def test_kv_arrives_bit_identical_in_the_decode_pool(prefill, decode, how):
    rng = random.Random(0)
    prompt = 1000
    src, dst = tables(prompt, rng)
    dest = destination(decode.call("address")["address"], dst, how=how)
    posted = decode.call("receive", prompt_len=prompt, destination=dest)
    sent = prefill.call(
        "send", prompt_len=prompt, src_table=src, destination=dest, chunk_tokens=128
    )
    landed = decode.call("wait", base_tag=dest["base_tag"], timeout_s=30)
    assert sent["ok"] and landed["complete"], (sent, landed)
    # whole blocks travel: the last one's 8 positions past the prompt too
    assert sent["bytes"] == landed["bytes"] == posted["bytes"] == 1008 * 2 * 30 * 3 * 64 * 4
    # staged: one message per segment of 256 tokens; push: one per run, the scattered half many
    assert sent["pieces"] == landed["landed"]
    assert sent["pieces"] == 4 if how == "staged" else sent["pieces"] > 20
    assert decode.call("digest", table=dst, start=0, end=prompt) == prefill.call(
        "digest", table=src, start=0, end=prompt
    )
    # shared memory, not loopback TCP, between two processes of one host
    assert "tcp" not in sent["transport"] and "sysv" in sent["transport"], sent["transport"]


@pytest.mark.parametrize("how", ["push", "staged"])
def test_only_the_missing_suffix_is_sent(prefill, decode, how):
    rng = random.Random(1)
    prompt, skip = 700, 256
    src, dst = tables(prompt, rng)
    zeros = decode.call("digest", table=dst, start=0, end=skip)
    dest = destination(decode.call("address")["address"], dst[skip // BS :], skip=skip, how=how)
    posted = decode.call("receive", prompt_len=prompt, destination=dest)
    sent = prefill.call("send", prompt_len=prompt, src_table=src, destination=dest)
    landed = decode.call("wait", base_tag=dest["base_tag"], timeout_s=30)
    assert sent["ok"] and landed["complete"]
    assert landed["bytes"] == posted["bytes"] == (704 - skip) * 2 * 30 * 3 * 64 * 4
    assert decode.call("digest", table=dst, start=skip, end=prompt) == prefill.call(
        "digest", table=src, start=skip, end=prompt
    )
    # the held prefix is untouched
    assert decode.call("digest", table=dst, start=0, end=skip) == zeros


def test_a_stalled_sender_is_caught_by_the_lease_and_every_receive_released(decode, helper):
    with KVPeer(LAYOUT, num_blocks=160, seed=3, helper=helper) as slow:
        slow.call("address")  # up and connected to UCX
        rng = random.Random(2)
        prompt = 2048
        src, dst = tables(prompt, rng)
        dest = destination(decode.call("address")["address"], dst, segment=256)
        posted = decode.call("receive", prompt_len=prompt, destination=dest)
        slow.start(
            "send",
            prompt_len=prompt,
            src_table=src,
            destination=dest,
            chunk_tokens=256,
            chunk_delay_s=0.5,
        )
        wait_for_first_piece(decode, dest)
        os.kill(slow.process.pid, signal.SIGSTOP)  # then the sender stops dead
        try:
            landed = decode.call("wait", base_tag=dest["base_tag"], timeout_s=20, lease_s=1.0)
            assert not landed["complete"] and "no KV piece landed" in landed["error"], landed
            assert 0 < landed["landed"] < posted["pieces"]
            aborted = decode.call("abort", base_tag=dest["base_tag"])
            assert aborted["safe"] and aborted["released"] == posted["pieces"] - landed["landed"]
        finally:
            os.kill(slow.process.pid, signal.SIGCONT)
            slow.kill()


def test_a_sender_killed_mid_transfer_leaves_no_receive_open(decode, helper):
    with KVPeer(LAYOUT, num_blocks=160, seed=4, helper=helper) as doomed:
        doomed.call("address")
        rng = random.Random(3)
        prompt = 2048
        src, dst = tables(prompt, rng)
        dest = destination(decode.call("address")["address"], dst, segment=256)
        posted = decode.call("receive", prompt_len=prompt, destination=dest)
        doomed.start(
            "send",
            prompt_len=prompt,
            src_table=src,
            destination=dest,
            chunk_tokens=256,
            chunk_delay_s=0.3,
        )
        wait_for_first_piece(decode, dest)
        doomed.kill()  # between two segments, pieces still to come
        landed = decode.call("wait", base_tag=dest["base_tag"], timeout_s=20, lease_s=1.0)
        assert not landed["complete"]
        aborted = decode.call("abort", base_tag=dest["base_tag"])
        assert aborted["safe"] and aborted["released"] >= posted["pieces"] - landed["landed"]
    # the decode side still takes a transfer from a new sender
    with KVPeer(LAYOUT, num_blocks=160, seed=5, helper=helper) as fresh:
        dest = destination(decode.call("address")["address"], dst[:8])
        decode.call("receive", prompt_len=128, destination=dest)
        assert fresh.call("send", prompt_len=128, src_table=src[:8], destination=dest)["ok"]
        assert decode.call("wait", base_tag=dest["base_tag"], timeout_s=20)["complete"]


def test_a_restarted_peer_is_reached_through_a_new_endpoint(prefill, helper):
    rng = random.Random(4)
    src, dst = tables(256, rng)
    with KVPeer(LAYOUT, num_blocks=192, helper=helper) as first:
        dest = destination(first.call("address")["address"], dst)
        first.call("receive", prompt_len=256, destination=dest)
        assert prefill.call("send", prompt_len=256, src_table=src, destination=dest)["ok"]
        assert first.call("wait", base_tag=dest["base_tag"], timeout_s=20)["complete"]
        gone = dest["ucx_address"]
    # the decode worker died and came back: a send to its old address fails within its timeout...
    failed = prefill.call(
        "send", prompt_len=256, src_table=src, destination=destination(gone, dst), timeout_s=2.0
    )
    assert not failed["ok"]
    # ...and its new incarnation, at a new address, gets the next transfer
    with KVPeer(LAYOUT, num_blocks=192, helper=helper) as second:
        dest = destination(second.call("address")["address"], dst)
        second.call("receive", prompt_len=256, destination=dest)
        assert prefill.call("send", prompt_len=256, src_table=src, destination=dest)["ok"]
        assert second.call("wait", base_tag=dest["base_tag"], timeout_s=20)["complete"]
        assert second.call("digest", table=dst, start=0, end=256) == prefill.call(
            "digest", table=src, start=0, end=256
        )


def test_only_an_announced_transfer_lands(prefill, decode, helper):
    """A peer that reaches the decode worker's UCX address but sends under a transfer tag the
    control plane never announced writes nothing: receives match announced tags (39 random bits
    each) only; the announced transfer lands bit for bit beside it."""
    rng = random.Random(3)
    prompt = 300
    src, dst = tables(prompt, rng)
    address = decode.call("address")["address"]
    before = decode.call("digest", table=dst, start=0, end=prompt)
    with KVPeer(LAYOUT, num_blocks=160, seed=99, helper=helper) as rogue:
        announced = destination(address, dst)  # receives posted into dst, waiting for their tag
        decode.call("receive", prompt_len=prompt, destination=announced)
        forged = destination(address, dst)  # the same blocks, a tag nobody announced
        rogue.call("send", prompt_len=prompt, src_table=src, destination=forged, timeout_s=2)
        waited = decode.call("wait", base_tag=announced["base_tag"], timeout_s=0.5)
        assert waited["landed"] == 0 and not waited["complete"], waited
        assert decode.call("digest", table=dst, start=0, end=prompt) == before
        sent = prefill.call("send", prompt_len=prompt, src_table=src, destination=announced)
        landed = decode.call("wait", base_tag=announced["base_tag"], timeout_s=30)
        assert sent["ok"] and landed["complete"], (sent, landed)
        assert (
            decode.call("digest", table=dst, start=0, end=prompt)
            == prefill.call("digest", table=src, start=0, end=prompt)
            != rogue.call("digest", table=src, start=0, end=prompt)
        )


def test_a_crash_inside_ucx_costs_only_the_transfers_in_flight():
    """The decode side's helper dies as UCX's use after free kills it (SIGSEGV) mid-transfer: the
    worker process lives on, the transfer fails at once, no receive stays open, a new helper
    takes over at a new address, and the next transfer lands bit for bit."""
    rng = random.Random(5)
    prompt = 2048
    src, dst = tables(prompt, rng)
    with (
        KVPeer(LAYOUT, num_blocks=160, seed=6, helper=True) as sender,
        KVPeer(LAYOUT, num_blocks=192, helper=True) as receiver,
    ):
        old = receiver.call("address")["address"]
        dest = destination(old, dst, segment=256)
        receiver.call("receive", prompt_len=prompt, destination=dest)
        sender.start(
            "send", prompt_len=prompt, src_table=src, destination=dest,
            chunk_tokens=256, chunk_delay_s=0.3, timeout_s=5.0,
        )  # fmt: skip
        wait_for_first_piece(receiver, dest)
        doomed = receiver.call("counters")["helper_pid"]
        os.kill(doomed, signal.SIGSEGV)
        landed = receiver.call("wait", base_tag=dest["base_tag"], timeout_s=20, lease_s=5.0)
        assert not landed["complete"] and "helper" in landed["error"], landed
        assert receiver.call("abort", base_tag=dest["base_tag"], timeout_s=5.0)["safe"]
        assert not sender.result(wait_s=60)["ok"]  # its peer went away: the send fails, in time
        after = receiver.call("counters")
        assert after["plane_restarts"] == 1 and after["helper_pid"] not in (0, doomed), after
        # the same worker, through its new helper, takes the next transfer
        dest = destination(receiver.call("address")["address"], dst, segment=256)
        assert dest["ucx_address"] != old
        receiver.call("receive", prompt_len=prompt, destination=dest)
        assert sender.call("send", prompt_len=prompt, src_table=src, destination=dest)["ok"]
        assert receiver.call("wait", base_tag=dest["base_tag"], timeout_s=30)["complete"]
        assert receiver.call("digest", table=dst, start=0, end=prompt) == sender.call(
            "digest", table=src, start=0, end=prompt
        )
