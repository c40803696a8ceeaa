"""A real Prometheus (Debian's package; .ci/run installs it) scrapes every service of a running
stack under a short load: its query API reports what the test sent, and `promtool check metrics`
finds nothing wrong with any endpoint's exposition. The same stack exports its traces to an OTLP
receiver of the test's own: one request, one trace, across the four services."""

import concurrent.futures
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from shared.cli.processes import free_port, wait_for_port
from tests.integration.helpers import chat_request, collect, long_document
from tests.integration.otlp_receiver import OtlpReceiver
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install prometheus; .ci/run does)")
    return found


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(processes, nats, receiver):
    """Every service with metrics, and traces to `receiver`."""
    stack = start_stack(
        processes,
        nats,
        "it-metrics",
        "auto",
        extra_env={"TANDEM_LOCAL_PREFILL_TOKENS": "64", "TANDEM_OTLP_ENDPOINT": receiver.url},
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def prometheus(processes, stack):
    """A Prometheus server scraping every service of `stack` every half second; its URL."""
    binary = _binary("prometheus")
    targets = stack.metrics_ports
    home = Path(tempfile.mkdtemp(prefix="tandem-prometheus-"))
    jobs = [
        {
            "job_name": name,
            "scrape_interval": "500ms",
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
        }
        for name, port in targets.items()
    ]
    (home / "prometheus.yml").write_text(json.dumps({"scrape_configs": jobs}))
    port = free_port()
    proc = processes.spawn(
        "prometheus",
        [
            binary,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        None,
    )
    assert wait_for_port("127.0.0.1", port, 30), processes.log_tail("prometheus")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(15)


def _query(prometheus: str, promql: str) -> dict[str, float]:
    """The instant query's result, {labels as text: value}."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return {
        json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
        for r in body["data"]["result"]
    }


def _until(prometheus: str, promql: str, expected: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while sum(found := _query(prometheus, promql).values()) != expected:
        assert time.monotonic() < deadline, (promql, found, expected)
        time.sleep(0.5)


def _load(stack) -> dict:
    """What the test sends: gRPC requests short (prefilled on the decode worker) and long (on the
    prefill worker), OpenAI requests, and invalid ones. What each part came to."""
    short = [chat_request(f"Name a colour, {n}.", 6, ignore_eos=True) for n in range(6)]
    long = [
        chat_request(f"{long_document(300)} Question {n}?", 4, ignore_eos=True) for n in range(2)
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda r: collect(stack.stub(), r), short + long))
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
    for n in range(3):
        client.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            prompt=f"Count to {n + 3}:",
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            collect(stack.stub(), chat_request("hi", 0))  # max_tokens 0: INVALID_ARGUMENT
    return {
        "grpc_ok": len(answers),
        "tokens": sum(len(ids) for _, ids, _ in answers) + 3 * 5,
        "disaggregated": sum(a[0][-1].timing.path == "disaggregated" for a in answers),
    }


def test_prometheus_scrapes_what_was_sent(stack, prometheus):
    sent = _load(stack)
    assert sent["disaggregated"] == 2
    q = lambda promql: _query(prometheus, promql)  # noqa: E731
    _until(prometheus, "sum(tandem_requests_total)", sent["grpc_ok"] + 3 + 2)
    by_status = q("sum by (api, status) (tandem_requests_total)")
    assert by_status == {
        '{"api": "grpc", "status": "ok"}': sent["grpc_ok"],
        '{"api": "grpc", "status": "invalid_argument"}': 2,
        '{"api": "openai", "status": "ok"}': 3,
    }
    assert sum(q("sum(tandem_time_to_first_token_seconds_count)").values()) == sent["grpc_ok"] + 3
    assert sum(q("sum(tandem_generation_tokens_total)").values()) == sent["tokens"]
    paths = q('sum by (path) (tandem_requests_total{status="ok"})')
    assert paths['{"path": "disaggregated"}'] == 2
    _until(prometheus, 'sum(tandem_scheduler_placements_total{path="disaggregated"})', 2)
    placed = (  # by the schedulers, and by the gateway in the rooms they named
        "sum(tandem_scheduler_placements_total) + sum(tandem_gateway_direct_placed_total)"
        " - sum(tandem_gateway_direct_turned_away_total)"
    )
    _until(prometheus, placed, sent["grpc_ok"] + 3)
    _until(prometheus, "count(up == 1)", 4)  # every target scraped, each a success
    ups = q("up")
    assert len(ups) == 4 and set(ups.values()) == {1.0}, ups
    _until(prometheus, 'count(tandem_kv_transfer_bytes_total{direction="received"} > 0)', 1)
    _until(prometheus, "count(tandem_kv_transfer_seconds_count > 0)", 1)
    _until(prometheus, 'count(tandem_engine_step_seconds_count{role="prefill"} > 0)', 1)
    _until(prometheus, 'sum(tandem_scheduler_live_workers{pool=~"prefill|decode"})', 2)
    _until(prometheus, "sum(tandem_kv_blocks_used)", 0)
    assert sum(q("sum(tandem_kv_blocks_capacity)").values()) > 0


def test_every_endpoint_passes_promtool(stack):
    promtool = _binary("promtool")
    for name, port in stack.metrics_ports.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read()
        assert b"tandem_" in text, name
        done = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
        )
        assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
            name,
            done.stdout.decode(),
            done.stderr.decode(),
        )


def test_the_dashboards_queries_run(stack, prometheus):
    """Every query of the Grafana dashboard runs, and every metric it reads is exported."""
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/tandem.json").read_text())
    exported = set()
    for port in stack.metrics_ports.values():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            exported |= set(re.findall(r"^(tandem_\w+)", reply.read().decode(), re.M))
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            _query(prometheus, target["expr"])  # a query that does not parse fails here
            for name in re.findall(r"tandem_\w+", target["expr"]):
                assert name in exported, (panel["title"], name)


# each span's parent, by name: one trace from the gateway through the scheduler to the workers
PARENTS = {
    "gateway.request": None,
    "gateway.validate": "gateway.request",
    "gateway.tokenize": "gateway.validate",
    "gateway.submit": "gateway.request",
    "gateway.stream": "gateway.request",
    "scheduler.queue": "gateway.submit",
    "scheduler.route": "gateway.submit",
    "decode.admit": "scheduler.route",
    "prefill.queue": "decode.admit",
    "prefill.compute": "decode.admit",
    "prefill.kv_send": "decode.admit",
    "decode.kv_receive": "decode.admit",
    "decode.decode": "decode.admit",
}


def test_one_trace_spans_all_four_services(stack, receiver):
    ask = chat_request(f"{long_document(300)} Which place is named first?", 4)
    ask.request_id = "trace-me"
    collect(stack.stub(), ask)  # long: prefilled on the prefill worker
    deadline = time.monotonic() + 30
    while True:
        roots = [s for s in receiver.spans if s.attributes.get("request_id") == "trace-me"]
        spans = [s for s in receiver.spans if roots and s.trace_id == roots[0].trace_id]
        if {s.name for s in spans} >= set(PARENTS):
            break
        assert time.monotonic() < deadline, sorted({(s.service, s.name) for s in spans})
        time.sleep(0.5)
    by_id = {s.span_id: s for s in spans}
    services = {s.service for s in spans}
    assert services == {"tandem-gateway", "tandem-scheduler", "tandem-prefill", "tandem-decode"}
    for span in spans:
        if span.name not in PARENTS:
            continue
        parent = by_id.get(span.parent_id)
        assert (parent.name if parent else None) == PARENTS[span.name], span
        assert span.start_ns <= span.end_ns
    (root,) = [s for s in spans if s.name == "gateway.request"]
    assert root.attributes["status"] == "OK"
    log = Path(stack.group.log_dir / "it-metrics-gateway.log").read_text()
    placed = [line for line in log.splitlines() if "placed:" in line and "[trace-me." in line]
    assert placed and f"trace={root.trace_id}" in placed[0], placed
