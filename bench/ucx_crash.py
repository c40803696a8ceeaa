"""UCX peer-death experiment (`python bench/ucx_crash.py`): does a receiver survive a sender that
is SIGKILLed while its KV pieces are on the wire?

Two real processes (harness/kv_peer.py) over real UCX, as a prefill and a decode worker are:
the receiver posts every piece of a 2,048-token prompt, the sender sends it a segment at a time
with a pause standing in for each segment's compute (`--chunk-tokens`, `--chunk-delay-s`; 0 sends
it all at once), and is SIGKILLed at a random moment between its first piece landing and
`--kill-within-s` later, so that most kills land while pieces are on the wire. The receiver then
ends its receives (as a decode worker does on a dead peer) and must answer a command. A receiver
that died (a segfault inside UCX) is counted, and replaced for the next try; one that stops
answering is counted too (`answer_timeouts`). `--kill receiver` turns it around: the receiver is
SIGKILLed while pieces are on the wire, and the sender (a prefill worker) must survive. UCX_*
environment variables reach both processes and win over the data plane's own options: the same
experiment measures a UCX setting (UCX_RNDV_SCHEME=put_zcopy, =am) against the default (UCX's own
rendezvous, a cma read by the receiver); `--error-handling` puts both peers in UCX's
peer-failure mode: tcp, or shared memory with UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y
UCX_KEEPALIVE_INTERVAL=1s. `--helper` runs each peer's UCX in a data-plane helper process
(shared.dataplane.helper_plane): a crash inside UCX then kills the helper, which is counted
(`helper_restarts`) and replaced, and the peer itself (the worker) must survive.
Writes bench/results/ucx_crash.json (appending one entry per run).
"""

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.kv_peer import KVPeer  # noqa: E402
from shared.control.messages import KVLayout  # noqa: E402
from shared.kvtransfer.plan import new_base_tag  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BS = 16
LAYOUT = KVLayout(
    model="m", dtype="float32", num_layers=30, num_kv_heads=3, head_dim=64, block_size=BS
)
PROMPT = 2048


@dataclass
class Experiment:
    """One run's settings (from the flags) and its counts."""

    kill: str = "sender"  # which side is SIGKILLed
    pace: dict = field(default_factory=lambda: dict(chunk_tokens=256, chunk_delay_s=0.006))
    kill_within_s: float = 0.02
    peer: dict = field(default_factory=dict)  # KVPeer options: error_handling, helper
    unsafe_aborts: int = 0  # aborts that left receives open 3 s after their release
    answer_timeouts: int = 0  # commands the survivor did not answer
    helper_restarts: int = 0  # the survivor's data-plane helper replaced (it crashed)

    def answered(self, who: str, call) -> dict | None:
        try:
            return call()
        except (TimeoutError, RuntimeError, EOFError, OSError) as err:
            print(f"  the {who} did not answer: {err!r}", flush=True)
            self.answer_timeouts += 1
            return None


def transfer(receiver: KVPeer, rng: random.Random) -> tuple[list[int], dict]:
    """A prompt's source blocks and its destination in `receiver`'s pool."""
    n = PROMPT // BS
    src, dst = rng.sample(range(160), n), rng.sample(range(192), n)
    dest = dict(
        ucx_address=receiver.call("address")["address"],
        base_tag=new_base_tag(rng.getrandbits(39)),
        block_ids=dst,
        segment_tokens=256,
        lease_s=1.0,
    )
    return src, dest


def one_try(x: Experiment, receiver: KVPeer, rng: random.Random) -> str:
    """'survived', 'crashed' (the receiver died), 'wedged' (alive, but no piece lands any more)
    or 'skipped' (the send ended before the kill)."""
    if x.kill == "receiver":
        return one_reverse_try(x, receiver, rng)
    src, dest = transfer(receiver, rng)
    with KVPeer(LAYOUT, num_blocks=160, seed=1, **x.peer) as sender:
        sender.call("address")
        receiver.call("receive", prompt_len=PROMPT, destination=dest)
        sender.start("send", prompt_len=PROMPT, src_table=src, destination=dest, **x.pace)
        deadline = time.monotonic() + 20
        while not receiver.call("wait", base_tag=dest["base_tag"], timeout_s=0.002)["landed"]:
            if time.monotonic() > deadline:
                return "wedged"  # the receiver is alive, but nothing lands any more
        time.sleep(rng.uniform(0, x.kill_within_s))
        sender.kill()

    def settle() -> bool:
        landed = receiver.call("wait", base_tag=dest["base_tag"], timeout_s=10, lease_s=1.0)
        ended = receiver.call("abort", base_tag=dest["base_tag"], timeout_s=3.0, wait_s=30)
        x.unsafe_aborts += not ended["safe"]  # receives still open 3 s after their release
        receiver.call("counters", wait_s=10)
        return landed["complete"]

    complete = x.answered("receiver", settle)
    time.sleep(0.2)
    if not receiver.process.is_alive():
        return "crashed"
    return "skipped" if complete else "survived"


def one_reverse_try(x: Experiment, sender: KVPeer, rng: random.Random) -> str:
    """The receiver dies mid-transfer: 'survived' or 'crashed' (the sender died)."""
    with KVPeer(LAYOUT, num_blocks=192, **x.peer) as receiver:
        src, dest = transfer(receiver, rng)
        receiver.call("receive", prompt_len=PROMPT, destination=dest)
        sender.start(
            "send", prompt_len=PROMPT, src_table=src, destination=dest, timeout_s=5.0, **x.pace
        )
        deadline = time.monotonic() + 20
        while not receiver.call("wait", base_tag=dest["base_tag"], timeout_s=0.002)["landed"]:
            if time.monotonic() > deadline:
                sender.result(wait_s=60)  # its answer, so the next command gets its own
                return "skipped"
        time.sleep(rng.uniform(0, x.kill_within_s))
        receiver.kill()

    def settle() -> dict:
        sent = sender.result(wait_s=30)
        sender.call("counters", wait_s=10)
        return sent

    sent = x.answered("sender", settle) or {"ok": False}
    time.sleep(0.2)
    if not sender.process.is_alive():
        return "crashed"
    return "skipped" if sent.get("ok") else "survived"


def parse(argv) -> tuple[argparse.Namespace, Experiment]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=30)
    parser.add_argument("--label", default="default")
    parser.add_argument("--kill", choices=("sender", "receiver"), default="sender")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--chunk-delay-s", type=float, default=0.006)
    parser.add_argument("--kill-within-s", type=float, default=0.02)
    parser.add_argument(
        "--error-handling", action="store_true", help="both peers in UCX's peer-failure mode"
    )
    parser.add_argument(
        "--helper", action="store_true", help="both peers' UCX in a helper process of their own"
    )
    args = parser.parse_args(argv)
    x = Experiment(args.kill, kill_within_s=args.kill_within_s)
    x.pace.update(chunk_tokens=args.chunk_tokens, chunk_delay_s=args.chunk_delay_s)
    x.peer.update(error_handling=args.error_handling, helper=args.helper)
    return args, x


def restarts(peer: KVPeer) -> int | None:
    """The survivor's helper restarts (None: it did not say)."""
    try:
        return peer.call("counters", wait_s=10).get("plane_restarts")
    except (TimeoutError, RuntimeError, EOFError, OSError):
        return None


def main(argv=None) -> int:
    args, x = parse(argv)
    rng, exit_codes = random.Random(7), []
    outcomes = {"survived": 0, "crashed": 0, "wedged": 0, "skipped": 0}
    survivor = dict(num_blocks=192) if x.kill == "sender" else dict(num_blocks=160, seed=1)
    survivor.update(x.peer)
    peer = KVPeer(LAYOUT, **survivor).__enter__()
    try:
        for i in range(args.tries):
            outcome = x.answered("survivor", lambda p=peer: one_try(x, p, rng)) or "survived"
            time.sleep(1.0)  # a crash may come a moment after the receives ended
            if not peer.process.is_alive():
                outcome = "crashed"
            outcomes[outcome] += 1
            if outcome == "crashed":
                exit_codes.append(peer.process.exitcode)
                peer.__exit__(None, None, None)
                peer = KVPeer(LAYOUT, **survivor).__enter__()
            print(f"try {i + 1}: {outcome}", flush=True)
        x.helper_restarts = restarts(peer)
    finally:
        peer.__exit__(None, None, None)
    ucx_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    entry = {"label": args.label, "killed": x.kill, "ucx_env": ucx_env, "pace": x.pace, **x.peer}
    entry.update(kill_within_s=x.kill_within_s, **outcomes, unsafe_aborts=x.unsafe_aborts)
    entry.update(answer_timeouts=x.answer_timeouts, exit_codes=exit_codes)
    entry["helper_restarts"] = x.helper_restarts
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "ucx_crash.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*runs, entry], indent=2))
    print(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
