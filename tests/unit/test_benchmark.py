"""The serving benchmark: workloads, prompts, metrics, reports, and client + runner against a fake gateway."""

import json
import random
import statistics
import sys

import pytest

from shared.benchmark import plots, report
from shared.benchmark.client import GatewayUnreachable, RequestRecord
from shared.benchmark.lengths import (
    Fixed,
    LengthSpecError,
    Uniform,
    draw_pair,
    parse_lengths,
    parse_output_lengths,
)
from shared.benchmark.metrics import Stats, itl_ms, request_metrics, summarize
from shared.benchmark.prompts import PromptBuilder, token_count
from shared.benchmark.runner import run_workload
from shared.benchmark.slo import SLO, SLOError
from shared.benchmark.workload import RequestSpec, Workload, poisson_arrivals, request_specs
from shared.cli import main as cli
from shared.cli.processes import free_port
from tests.unit.bench_fakes import Behaviour, FakeGateway, WordTokenizer

# ---- lengths and arrivals ----


def test_fixed_and_uniform_lengths():
    rng = random.Random(0)
    assert parse_lengths("fixed:7") == Fixed(7) == parse_lengths("7")
    uniform = parse_lengths("uniform:3-6")
    assert uniform == Uniform(3, 6)
    assert {uniform.draw(rng) for _ in range(500)} == {3, 4, 5, 6}


@pytest.mark.parametrize(
    "spec", ["fixed:0", "fixed:x", "uniform:6-3", "uniform:5", "uniform:0-4", "normal:5", ""]
)
def test_bad_length_specs_are_refused(spec):
    with pytest.raises(LengthSpecError):
        parse_lengths(spec)


def test_file_of_single_lengths(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# a trace\n10\n\n20  # long\n30\n")
    lengths = parse_lengths(f"file:{path}")
    rng = random.Random(1)
    assert {lengths.draw(rng) for _ in range(300)} == {10, 20, 30}
    assert parse_output_lengths(f"file:{path}", lengths).draw(rng) in {
        10,
        20,
        30,
    }  # one column serves both


def test_pair_file_keeps_each_pair_together(tmp_path):
    path = tmp_path / "pairs.txt"
    path.write_text("100 1\n200 2\n300 3\n")
    prompt = parse_lengths(f"file:{path}", column=0)
    rng = random.Random(2)
    for output in (
        parse_output_lengths(None, prompt),
        parse_output_lengths(f"file:{path}", prompt),
    ):
        pairs = {draw_pair(prompt, output, rng) for _ in range(300)}
        assert pairs == {(100, 1), (200, 2), (300, 3)}
    assert parse_output_lengths(None, parse_lengths("fixed:5")) == Fixed(128)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no lengths"),
        ("10\nten\n", ":2: 'ten' is not an integer"),
        ("1 2 3\n", ":1: expected one length"),
        ("10\n20 2\n", "mixes"),
        ("10\n0\n", ":2: lengths must be at least 1"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(LengthSpecError, match=message):
        parse_lengths(f"file:{path}")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(LengthSpecError, match="cannot read"):
        parse_lengths(f"file:{tmp_path / 'nope.txt'}")


def test_poisson_gaps_are_exponential_with_mean_one_over_rate():
    times = [t for t, _ in zip(poisson_arrivals(4.0, seed=7), range(20001))]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd == mean
    again = [t for t, _ in zip(poisson_arrivals(4.0, seed=7), range(20001))]
    other = [t for t, _ in zip(poisson_arrivals(4.0, seed=8), range(20001))]
    assert again == times and other != times


def test_infinite_rate_sends_everything_at_once_and_zero_is_refused():
    assert [t for t, _ in zip(poisson_arrivals(float("inf")), range(5))] == [0.0] * 5
    with pytest.raises(ValueError):
        poisson_arrivals(0.0)


# ---- prompts ----


def test_prompts_have_exact_lengths_even_when_words_merge():
    tok = WordTokenizer()
    builder = PromptBuilder(tok, random.Random(3))
    for target in (2, 3, 17, 200, 1000):
        assert token_count(tok, builder.build(target)) == target


def test_shared_prefixes_start_the_prompts():
    tok = WordTokenizer()
    workload = Workload(
        parse_lengths("uniform:40-60"),
        parse_lengths("fixed:4"),
        shared_prefix_tokens=32,
        num_prefixes=3,
        tag="a b",
        seed=5,
    )
    specs = list(request_specs(workload, tok, 30))
    prefixes = {}
    for spec in specs:
        ids = tok(spec.prompt)["input_ids"]
        assert len(ids) == spec.prompt_len and 40 <= spec.prompt_len <= 60
        prefixes.setdefault(spec.prefix, set()).add(tuple(ids[:32]))
    assert sorted(prefixes) == [0, 1, 2] and all(len(v) == 1 for v in prefixes.values())
    assert len({s.prompt for s in specs}) == 30 and specs[4].request_id == "bench-a-b-4"
    # seeded
    assert [s.prompt for s in request_specs(workload, tok, 30)] == [s.prompt for s in specs]


def test_a_prefix_longer_than_the_prompts_is_refused():
    with pytest.raises(ValueError, match="shared prefix"):
        Workload(parse_lengths("uniform:20-60"), parse_lengths("fixed:4"), shared_prefix_tokens=20)


def test_prompts_match_the_gateway_token_count(tokenizer):
    """With the real tokenizer, as the gateway counts a raw prompt (services/gateway/validation.py)."""
    from services.gateway.prompt_tokenizer import PromptTokenizer
    from services.gateway.validation import prompt_ids_of
    from shared.api import tandem_pb2 as pb

    prompts = PromptTokenizer(tokenizer)

    workload = Workload(parse_lengths("uniform:1-600"), parse_lengths("fixed:1"), seed=11)
    specs = list(request_specs(workload, tokenizer, 20))
    specs += list(
        request_specs(
            Workload(parse_lengths("fixed:96"), parse_lengths("fixed:1"), 64, 2), tokenizer, 4
        )
    )
    for spec in specs:
        ids = prompt_ids_of(pb.GenerateRequest(prompt=spec.prompt), prompts)
        assert len(ids) == spec.prompt_len, spec


# ---- metrics ----


def record(
    index, sent, chunks, ended, status="OK", prompt_tokens=10, prompt_len=10
) -> RequestRecord:
    r = RequestRecord(
        index, f"r{index}", "", prompt_len, 4, 0, None, sent_at=sent, ended_at=ended, status=status
    )
    r.chunk_times = [t for t, _ in chunks]
    r.chunk_tokens = [n for _, n in chunks]
    r.prompt_tokens = prompt_tokens if status == "OK" else 0
    r.finish_reason = "length" if status == "OK" else ""
    return r


def test_request_metrics_split_a_chunk_gap_over_its_tokens():
    m = request_metrics(record(0, 100.0, [(100.1, 1), (100.15, 1), (100.35, 2)], 100.4))
    assert m.ttft_ms == pytest.approx(100) and m.e2e_ms == pytest.approx(400)
    assert m.output_tokens == 4 and m.tpot_ms == pytest.approx(100)  # (400 - 100) / 3
    assert m.itl_ms == pytest.approx([50, 100, 100])
    # the SLO judges the whole 200 ms wait for the last chunk
    assert m.max_itl_ms == pytest.approx(200)
    # the first chunk's extra tokens: none
    assert itl_ms([0.0, 0.5], [3, 5]) == pytest.approx([100] * 5)


def test_stats_percentiles():
    assert Stats.of([5, 1, 4, 2, 3]) == Stats(5, 3.0, 3.0, pytest.approx(4.6), pytest.approx(4.96))
    assert Stats.of([]) == Stats(0, None, None, None, None)


def three_records():
    return [
        record(0, 100.0, [(100.1, 1), (100.15, 1), (100.35, 2)], 100.4),  # ttft 100, max itl 100
        # ttft 200, one token
        record(1, 100.5, [(100.7, 1)], 100.8, prompt_tokens=20, prompt_len=21),
        record(2, 101.0, [], 101.1, status="RESOURCE_EXHAUSTED"),
    ]


def test_summary_counts_throughputs_and_latencies():
    s = summarize(three_records(), duration_s=2.0)
    assert (s.requests, s.completed, s.failed, s.failures) == (3, 2, 1, {"RESOURCE_EXHAUSTED": 1})
    assert (s.prompt_tokens, s.output_tokens, s.prompt_len_mismatches) == (30, 5, 1)
    assert (s.request_throughput, s.output_throughput, s.total_token_throughput) == (1.0, 2.5, 17.5)
    assert s.ttft_ms.mean == pytest.approx(150) and s.ttft_ms.count == 2
    assert s.tpot_ms.count == 1 and s.itl_ms.count == 3 and s.e2e_ms.median == pytest.approx(350)
    assert s.goodput is None and s.server["paths"] == {}
    assert summarize(three_records()).duration_s == pytest.approx(1.1)  # first send -> last end


@pytest.mark.parametrize(
    "slo, met",
    [
        ("ttft_ms=150", 1),
        ("ttft_ms=250", 2),
        ("itl_ms=80", 1),
        ("itl_ms=199", 1),
        ("itl_ms=200", 2),
        ("tpot_ms=99", 1),
        ("e2e_ms=300,ttft_ms=500", 1),
        ("e2e_ms=1,ttft_ms=1", 0),
    ],
)
def test_goodput_counts_completed_requests_meeting_every_objective(slo, met):
    s = summarize(three_records(), SLO.parse(slo), duration_s=2.0)
    assert s.slo_met == met and s.goodput == met / 2.0


@pytest.mark.parametrize("text", ["ttft=5", "ttft_ms", "ttft_ms=abc", "ttft_ms=0", "itl_ms=-3"])
def test_bad_slos_are_refused(text):
    with pytest.raises(SLOError):
        SLO.parse(text)


# ---- report ----


def test_json_round_trip_and_table(tmp_path):
    records = three_records()
    summary = summarize(records, SLO.parse("ttft_ms=150"), duration_s=2.0)
    path = report.write_json(tmp_path / "run.json", "run", {"rate": None}, records, summary)
    data = json.loads(path.read_text())
    assert data["summary"]["goodput"] == 0.5 and len(data["requests"]) == 3
    assert (
        data["requests"][0]["ttft_ms"] == pytest.approx(100)
        and data["requests"][1]["sent_at"] == 0.5
    )
    assert summarize(report.load_records(path), SLO.parse("ttft_ms=150"), 2.0) == summary
    text = report.table(summary, "run")
    for line in (
        "Completed requests:",
        "RESOURCE_EXHAUSTED 1",
        "Goodput (req/s), ttft_ms<=150",
        "TTFT",
    ):
        assert line in text


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.write_plots(tmp_path, "run", three_records())
    assert [p.name for p in paths] == ["run-latency-cdf.png", "run-ttft-vs-prompt.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_plots_without_matplotlib_say_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plots.MatplotlibMissing, match=r"pip install -e '\.\[bench\]'"):
        plots.write_plots(tmp_path, "run", three_records())


# ---- client and runner against a fake gateway ----


def specs(n: int, output_len: int = 5) -> list[RequestSpec]:
    return [RequestSpec(i, f"bench-{i}", f"w{i} x y", 3, output_len) for i in range(n)]


async def test_runner_records_completions_failures_and_ttft():
    with FakeGateway(Behaviour(first_token_s=0.2, gap_s=0.01, fail_every=4)) as gateway:
        records = await run_workload(gateway.address, specs(8), concurrency=4)
    s = summarize(records)
    assert (s.completed, s.failed, s.failures) == (6, 2, {"RESOURCE_EXHAUSTED": 2})
    assert {r.retry_after_ms for r in records if not r.ok} == {250}
    assert all(r.chunk_tokens == [1, 2, 2] and r.completion_tokens == 5 for r in records if r.ok)
    assert (
        all(request_metrics(r).ttft_ms >= 200 for r in records if r.ok) and s.ttft_ms.median < 700
    )
    assert s.server["paths"] == {"disaggregated": 6} and s.server["cached_tokens"] == 18
    sent = gateway.behaviour.received[0]
    assert (
        sent.sampling.ignore_eos
        and sent.sampling.temperature == 0
        and sent.sampling.max_tokens == 5
    )


async def test_concurrency_caps_the_requests_in_flight():
    with FakeGateway(Behaviour(first_token_s=0.05)) as gateway:
        records = await run_workload(gateway.address, specs(12), concurrency=3)
    assert len(records) == 12 and gateway.behaviour.max_in_flight == 3


async def test_arrivals_pace_the_sends_and_duration_stops_new_ones():
    with FakeGateway(Behaviour(first_token_s=0.01)) as gateway:
        records = await run_workload(
            gateway.address, specs(4), arrivals=[0.0, 0.2, 0.4, 5.0], duration_s=1.0
        )
    assert len(records) == 3
    offsets = [r.sent_at - records[0].sent_at for r in records]
    assert offsets[1] == pytest.approx(0.2, abs=0.1) and offsets[2] == pytest.approx(0.4, abs=0.1)


async def test_an_unreachable_gateway_is_an_error():
    with pytest.raises(GatewayUnreachable, match="no gateway answered"):
        await run_workload(f"127.0.0.1:{free_port()}", specs(1), connect_timeout_s=0.5)


# ---- the command line ----


def test_cli_bench_writes_results(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("shared.cli.bench.model_store.prepare", lambda model, cache: tmp_path)
    monkeypatch.setattr("shared.cli.bench.model_store.load_tokenizer", lambda path: WordTokenizer())
    with FakeGateway(Behaviour(first_token_s=0.05, fail_every=5)) as gateway:
        rc = cli.main(
            [
                "bench",
                "--address",
                gateway.address,
                "--num-requests",
                "10",
                "--concurrency",
                "3",
                "--prompt-len",
                "uniform:8-16",
                "--output-len",
                "fixed:4",
                "--warmup",
                "2",
                "--slo",
                "ttft_ms=10000",
                "--out-dir",
                str(tmp_path),
                "--label",
                "t1",
                "--no-plots",
            ]
        )
    out = capsys.readouterr().out
    assert rc == 0 and "Serving benchmark: t1" in out and "RESOURCE_EXHAUSTED 2" in out
    data = json.loads((tmp_path / "t1.json").read_text())
    assert (
        len(data["requests"]) == 10
        and data["summary"]["completed"] == 8
        and data["summary"]["slo_met"] == 8
    )
    assert data["config"]["cluster"]["mode"] == "fake" and data["config"]["rate"] is None
    # the two warm-up requests left out
    assert [r["index"] for r in data["requests"]] == list(range(2, 12))


def test_cli_bench_unreachable_gateway_exits_non_zero(capsys):
    rc = cli.main(["bench", "--address", f"127.0.0.1:{free_port()}", "--connect-timeout", "0.5"])
    assert rc == 1 and "no gateway answered" in capsys.readouterr().err


def test_cli_bench_bad_arguments_exit_2(capsys):
    assert cli.main(["bench", "--prompt-len", "uniform:9-1"]) == 2
    assert "uniform:9-1" in capsys.readouterr().err
