"""Client flood (`make bench-flood`): can one client starve the others?

One stack (auto mode, a prefill and a decode worker, 1 thread each), API keys on: client A may
hold 8 streams (4 waiting) at the highest priority it is allowed (5), client B the defaults.
  1. alone: B sends one short request a second for `--phase-s`; its TTFT is the baseline;
  2. flood: A opens streams with priority 2**31-1 and max_tokens 4096 until refused, keeps trying
     for more, and sends 64 concurrent 1 MiB prompts; B sends as in phase 1.
Bar: B's TTFT p99 under the flood within 2x of its p99 alone; A gets RESOURCE_EXHAUSTED (or
INVALID_ARGUMENT for the 1 MiB prompts) beyond its limits; no service exits.
Writes bench/results/flood.{md,json}.
"""

import argparse
import concurrent.futures
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.stack import BenchStack, Worker  # noqa: E402
from shared.api import tandem_pb2 as pb  # noqa: E402
from shared.api import tandem_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEY_A, KEY_B = "flood-a-" + "a" * 32, "steady-b-" + "b" * 32
A_STREAMS = 8


def keys_file() -> str:
    clients = [
        {"name": "a", "key": KEY_A, "max_priority": 5, "max_streams": A_STREAMS, "max_queued": 4},
        {"name": "b", "key": KEY_B},
    ]
    path = Path(tempfile.mkdtemp(prefix="tandem-flood-")) / "keys.json"
    path.write_text(json.dumps({"clients": clients}))
    path.chmod(0o600)
    return str(path)


def auth(key: str):
    return (("authorization", f"Bearer {key}"),)


def ttft_ms(stub, request, key: str) -> float | None:
    """Time to the first token of one request (None: it failed)."""
    started = time.perf_counter()
    try:
        for response in stub.Generate(request, metadata=auth(key), timeout=120):
            if response.token_ids:
                return (time.perf_counter() - started) * 1000
    except grpc.RpcError as err:
        print(f"B failed: {err.code().name}: {err.details()}", flush=True)
    return None


def steady_b(stub, phase_s: float) -> list[float | None]:
    """One short request a second for phase_s, each waited for (TTFTs)."""
    out, deadline = [], time.monotonic() + phase_s
    while time.monotonic() < deadline:
        started = time.monotonic()
        request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=8))
        request.messages.add(role="user", content=f"Name a colour. ({len(out)})")
        out.append(ttft_ms(stub, request, KEY_B))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    return out


def flood_a(stub, stop: threading.Event, codes: Counter) -> None:
    """A: long streams at the top priority until refused, and again; 64 x 1 MiB prompts."""

    def stream() -> None:
        while not stop.is_set():
            request = pb.GenerateRequest(
                prompt="Tell a very long story.",
                sampling=pb.SamplingParams(max_tokens=4096, ignore_eos=True),
                priority=2**31 - 1,
            )
            try:
                for _ in stub.Generate(request, metadata=auth(KEY_A), timeout=600):
                    if stop.is_set():
                        break
                codes["OK"] += 1
            except grpc.RpcError as err:
                codes[err.code().name] += 1
                time.sleep(0.2)

    def huge() -> None:
        request = pb.GenerateRequest(prompt="word " * (200 * 1024), priority=2**31 - 1)
        try:
            for _ in stub.Generate(request, metadata=auth(KEY_A), timeout=120):
                pass
            codes["huge OK"] += 1
        except grpc.RpcError as err:
            codes[f"huge {err.code().name}"] += 1

    with concurrent.futures.ThreadPoolExecutor(A_STREAMS + 4 + 64) as pool:
        for _ in range(A_STREAMS + 4):  # more than it may hold
            pool.submit(stream)
        for _ in range(64):
            pool.submit(huge)
        stop.wait()


def summary(values: list[float | None]) -> dict:
    done = [v for v in values if v is not None]
    return {
        "requests": len(values),
        "failed": len(values) - len(done),
        "ttft_p50_ms": float(np.percentile(done, 50)) if done else float("nan"),
        "ttft_p99_ms": float(np.percentile(done, 99)) if done else float("nan"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    workers = [Worker("prefill", "0", 1), Worker("decode", "1", 1)]
    env = {"TANDEM_API_KEYS_FILE": keys_file()}
    with BenchStack("flood", "auto", workers, gateway_env=env, metadata=auth(KEY_B)) as stack:
        stub = pb_grpc.TandemStub(grpc.insecure_channel(stack.address))
        alone = steady_b(stub, args.phase_s)
        stop, codes = threading.Event(), Counter()
        flooding = threading.Thread(target=flood_a, args=(stub, stop, codes), daemon=True)
        flooding.start()
        time.sleep(5.0)  # A holds its streams by now
        flooded = steady_b(stub, args.phase_s)
        stop.set()
        flooding.join(120)
        dead = stack.group.dead()
    out = {"b_alone": summary(alone), "b_flooded": summary(flooded), "a_outcomes": dict(codes)}
    out["ratio_p99"] = out["b_flooded"]["ttft_p99_ms"] / out["b_alone"]["ttft_p99_ms"]
    out["services_exited"] = [name for name, _ in dead]
    out["bar_met"] = bool(
        out["ratio_p99"] <= 2.0
        and not dead
        and not out["b_flooded"]["failed"]
        and codes["RESOURCE_EXHAUSTED"] > 0
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "flood.json").write_text(json.dumps(out, indent=2))
    (RESULTS / "flood.md").write_text(report(out))
    print(report(out))
    return 0 if out["bar_met"] else 1


def report(out: dict) -> str:
    a, f = out["b_alone"], out["b_flooded"]
    return "\n".join(
        [
            "# Client flood: B's time to first token, alone and while A floods",
            "",
            "| B's requests | done | TTFT p50 (ms) | TTFT p99 (ms) |",
            "|---|---|---|---|",
            f"| A absent | {a['requests'] - a['failed']}/{a['requests']} | "
            f"{a['ttft_p50_ms']:.0f} | {a['ttft_p99_ms']:.0f} |",
            f"| A flooding | {f['requests'] - f['failed']}/{f['requests']} | "
            f"{f['ttft_p50_ms']:.0f} | {f['ttft_p99_ms']:.0f} |",
            "",
            f"p99 ratio: **{out['ratio_p99']:.2f}** (bar: at most 2). A's outcomes: "
            f"{out['a_outcomes']}. Services exited: {out['services_exited'] or 'none'}.",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
