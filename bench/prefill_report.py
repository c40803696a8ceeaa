"""The prefill benchmark's table and plot (bench/prefill.py)."""

from pathlib import Path


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "—"


def _peer_rate(results: dict, name: str, length: str) -> float | None:
    peer = results.get(name) or {}
    return (peer.get(length) or {}).get("tokens_per_s")


def table(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Prefill: prompt tokens/s and TTFT against prompt length",
        "",
        f"Machine: {m['threads']} threads, {m['cpu_capability']}, fp32 GEMM peak "
        f"{m['gemm_gflops']:.0f} GFLOP/s. One prompt at a time, prefill only (a prefill worker's "
        "job), seeded random token ids, nothing cached. GEMM-bound: the linear layers' FLOPs at "
        "the GEMM peak (attention free); floor: linear + causal attention FLOPs at that peak.",
        "",
        "| model | prompt tokens | TTFT s | tok/s | % of GEMM-bound | % of floor | vLLM-CPU tok/s | × vLLM | llama.cpp tok/s | × llama.cpp |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, name in (("tandem", "SmolLM2-135M"), ("long", "32k ckpt, 4 layers")):
        for length, r in (results.get(key) or {}).items():
            vllm = _peer_rate(results, "vllm", length) if key == "tandem" else None
            llama = _peer_rate(results, "llama_cpp", length) if key == "tandem" else None
            lines.append(
                f"| {name} | {length} | {r['ttft_s']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['tokens_per_s'] / r['gemm_bound_tokens_per_s']:.0%} | "
                f"{r['tokens_per_s'] / r['floor_tokens_per_s']:.0%} | "
                f"{f'{vllm:.0f}' if vllm else '—'} | {_ratio(r['tokens_per_s'], vllm)} | "
                f"{f'{llama:.0f}' if llama else '—'} | {_ratio(r['tokens_per_s'], llama)} |"
            )
    lines += ["", *growth(results)]
    chunks = results.get("chunks")
    if chunks:
        lines += [
            "",
            "Step size on a colocated worker: a 4k prompt arriving while 8 sequences decode.",
            "",
            "| rows per step | prompt chunk | TTFT s | decode ITL meanwhile, ms | steps |",
            "|---|---|---|---|---|",
        ]
        for rows, c in chunks.items():
            lines.append(
                f"| {rows} | {c['chunk']} | {c['ttft_s']:.2f} | {c['itl_ms']:.0f} | {c['steps']} |"
            )
    return "\n".join(lines) + "\n"


def growth(results: dict) -> list[str]:
    """TTFT ratios against the compute floor's own ratio (what exact causal attention costs)."""
    out = []
    for key, (a, b) in (("tandem", ("2048", "8190")), ("long", ("8192", "32760"))):
        r = results.get(key) or {}
        if a in r and b in r:
            measured = r[b]["ttft_s"] / r[a]["ttft_s"]
            floor = (int(b) / r[b]["floor_tokens_per_s"]) / (int(a) / r[a]["floor_tokens_per_s"])
            out.append(
                f"- {key}: TTFT({b}) / TTFT({a}) = {measured:.2f} (the compute floor's ratio: "
                f"{floor:.2f}; linear would be {int(b) / int(a):.1f}, pure quadratic {(int(b) / int(a)) ** 2:.0f})"
            )
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("tandem", "Tandem, SmolLM2"), ("long", "Tandem, 32k ckpt (4 layers)")):
        r = results.get(key) or {}
        xs = [int(x) for x in r]
        if not xs:
            continue
        rate.plot(xs, [v["tokens_per_s"] for v in r.values()], "o-", label=label)
        rate.plot(
            xs, [v["floor_tokens_per_s"] for v in r.values()], ":", label=f"{label}: compute floor"
        )
        ttft.plot(xs, [v["ttft_s"] for v in r.values()], "o-", label=label)
    r = results.get("tandem") or {}
    if r:
        rate.plot(
            [int(x) for x in r],
            [v["gemm_bound_tokens_per_s"] for v in r.values()],
            "--",
            label="SmolLM2 GEMM-bound",
        )
    for name, label in (("vllm", "vLLM-CPU"), ("llama_cpp", "llama.cpp (Q4_1)")):
        peer = {k: v for k, v in (results.get(name) or {}).items() if isinstance(v, dict)}
        if peer:
            xs = [int(x) for x in peer]
            rate.plot(xs, [v["tokens_per_s"] for v in peer.values()], "s-", label=label)
            ttft.plot(xs, [v["ttft_s"] for v in peer.values()], "s-", label=label)
    rate.set(
        xscale="log", xlabel="prompt tokens", ylabel="prompt tokens/s", title="Prefill throughput"
    )
    ttft.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="seconds",
        title="Time to first token",
    )
    for ax in (rate, ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
