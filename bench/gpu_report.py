"""The GPU check's report (bench/gpu_check.py) as Markdown: a table per step, its JSON after."""

import json


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    lines = ["# GPU check", ""]
    lines.append(
        f"{env.get('gpu') or 'CPU (dry run)'}; torch {env.get('torch')}, CUDA "
        f"{env.get('cuda')}, Triton {env.get('triton')}, ucxx {env.get('ucxx')}, "
        f"Python {env.get('python')}. Checkpoint: {report.get('checkpoint', {})}."
    )
    lines.append("")
    for section in (_parity, _decode, _ttft, _kv, _tp, _masks):
        lines += section(report)
    for name, error in report.get("errors", {}).items():
        lines += [f"**{name} failed:**", "```", error.strip()[-1500:], "```", ""]
    lines += ["```json", json.dumps(report, indent=1)[:20000], "```", ""]
    return "\n".join(lines)


def _table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def _parity(report: dict) -> list[str]:
    parity = report.get("parity")
    if not parity:
        return []
    f32, b16 = parity.get("float32", {}), parity.get("bfloat16", {})
    served = f32.get("disaggregated", {})

    def share(d: dict) -> str:
        return f"{d.get('identical')}/{d.get('of')}" if d else ""

    rows = [
        ["engine in-process", share(f32), share(b16)],
        ["disaggregated (prefill + decode worker, KV over UCX)", share(served), ""],
    ]
    return _table(["greedy tokens equal to HF `generate`", "float32", "bfloat16"], rows)


def _decode(report: dict) -> list[str]:
    decode = report.get("decode")
    if not decode:
        return []
    head = ["streams", "engine tok/s", "engine, no CUDA graphs", "HF generate", "engine / HF"]
    rows = [
        [
            n,
            f"{row['engine_tokens_per_s']:.0f}",
            _count(row.get("engine_eager_tokens_per_s")),
            f"{row['hf_tokens_per_s']:.0f}",
            f"{row['ratio']:.1f}",
        ]
        for n, row in decode.items()
    ]
    return [f"Engine kernels: {report.get('kernels')}.", ""] + _table(head, rows)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"  # none on CPU: no graphs there


def _ttft(report: dict) -> list[str]:
    rows = [
        [n, f"{row['ttft_s'] * 1e3:.1f} ms", f"{row['tokens_per_s']:.0f}"]
        for n, row in report.get("ttft", {}).items()
    ]
    return _table(["prompt tokens", "TTFT", "prompt tokens/s"], rows) if rows else []


def _kv(report: dict) -> list[str]:
    kv = report.get("kv")
    if not kv:
        return []
    head = [
        "progress",
        "prompt tokens",
        "segment tokens",
        "GB/s",
        "device copy GB/s",
        "of the copy",
    ]
    rows = [
        [r["progress"], r["tokens"], r["segment_tokens"], f"{r['gbps']:.0f}"]
        + [f"{r['copy_gbps']:.0f}", f"{r['vs_copy']:.0%}"]
        for r in kv.get("rows", [])
    ]
    title = f"KV transfer, {kv.get('layout')}; UCX transports: {kv.get('transports')}."
    return [title, ""] + _table(head, rows)


def _tp(report: dict) -> list[str]:
    tp = report.get("tp")
    if not tp or "kv" not in tp:
        return []
    kv = tp["kv"]
    equal = f"{kv['ok']} (exact: {kv['exact']}, max diff {kv['max_abs_diff']:.1e} of {kv['largest']:.2g})"
    moved = f"{kv['moved']}: {kv['bytes_per_rank']} bytes per rank of {kv['whole_bytes']}"
    rows = [
        ["group", f"TP=2 over {tp['backend']} on {', '.join(tp['devices'])}; {tp['reduce']}"],
        ["greedy tokens equal to HF `generate` (fp32)", f"{tp['identical']}/{len(tp['prompts'])}"],
        ["KV TP=2 -> TP=1 equal to the whole model's", equal],
        ["KV moved", moved],
        ["NCCL group of one (all-reduce of a CUDA tensor)", _nccl_one(tp.get("nccl_one", {}))],
        ["seconds", f"load {tp['load_s']:.1f}, prompts {tp['prompt_s']:.2f}, decode "
                    f"{tp['decode_s']:.2f}, KV {kv['transfer_s'] * 1e3:.1f} ms"],
    ]  # fmt: skip
    title = f"Tensor parallel, prompts of {tp['prompts']} tokens, {tp['new_tokens']} new each."
    return [title, ""] + _table(["", "measured"], rows)


def _nccl_one(one: dict) -> str:
    if one.get("skipped") or one.get("ok"):
        return one.get("skipped") or f"ok, NCCL {one.get('nccl')}"
    return "failed: " + " ".join(str(one.get("error")).split())[-300:].replace("|", "/")


def _masks(report: dict) -> list[str]:
    masks = report.get("masks")
    if not masks:
        return []
    rows = [[n, row["identical"], f"{row['ms']:.3f}"] for n, row in masks.get("rows", {}).items()]
    title = f"Grammar masks applied on the device, {masks.get('vocab')}-token rows:"
    return [title, ""] + _table(["rows", "= the CPU's", "ms a step"], rows)
