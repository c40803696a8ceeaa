"""The serving benchmark (`tandem bench`), usable as a library.

    specs = list(request_specs(Workload(parse_lengths("fixed:256"), parse_lengths("fixed:64")), tokenizer, 100))
    records = await run_workload("127.0.0.1:50051", specs, arrivals=poisson_arrivals(4.0))
    print(table(summarize(records, SLO.parse("ttft_ms=500"))))

Several workloads can run at once (asyncio.gather of run_workload calls); `summarize` takes any
subset of records, e.g. one workload's `tag`.
"""

from shared.benchmark.client import GatewayUnreachable, RequestRecord
from shared.benchmark.lengths import LengthSpecError, parse_lengths, parse_output_lengths
from shared.benchmark.metrics import Stats, Summary, request_metrics, summarize
from shared.benchmark.progress import Progress
from shared.benchmark.prompts import PromptBuilder, PromptError
from shared.benchmark.report import load_records, table, write_json
from shared.benchmark.runner import run_workload
from shared.benchmark.slo import SLO, SLOError
from shared.benchmark.workload import RequestSpec, Workload, poisson_arrivals, request_specs

__all__ = [
    "GatewayUnreachable",
    "LengthSpecError",
    "Progress",
    "PromptBuilder",
    "PromptError",
    "RequestRecord",
    "RequestSpec",
    "SLO",
    "SLOError",
    "Stats",
    "Summary",
    "Workload",
    "load_records",
    "parse_lengths",
    "parse_output_lengths",
    "poisson_arrivals",
    "request_metrics",
    "request_specs",
    "run_workload",
    "summarize",
    "table",
    "write_json",
]
