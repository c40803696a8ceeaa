"""`tandem status`: the table of workers, and the line per worker saying which kernels it runs;
the command line's time limits."""

import pytest

from shared.api import tandem_pb2 as pb
from shared.cli import client
from shared.cli.client import status_table

KERNELS = "avx2 · bfloat16 emulated · matmul torch · attention paged-c++ · decode-stack per-layer"


def worker(worker_id: str, **kw) -> pb.WorkerStatus:
    return pb.WorkerStatus(id=worker_id, role="decode", host="h", pid=7, kv_blocks_total=8, **kw)


def test_status_shows_each_workers_kernels_on_a_line_of_its_own():
    response = pb.ClusterStatusResponse(
        mode="auto", workers=[worker("decode-1", kernels=KERNELS), worker("prefill-12")]
    )
    table, kernels = status_table(response).split("\n\nkernels:\n")
    assert table.startswith("mode: auto\nWORKER") and "decode-1" in table
    assert kernels.splitlines() == [f"  decode-1    {KERNELS}", "  prefill-12  -"]


def test_workers_that_report_no_kernels_get_no_kernel_section():
    text = status_table(pb.ClusterStatusResponse(mode="auto", workers=[worker("decode-1")]))
    assert "kernels" not in text and "decode-1" in text


def test_status_shows_each_workers_model_architecture_and_dtype():
    model = "Qwen3-0.6B · Qwen3ForCausalLM · bfloat16"
    response = pb.ClusterStatusResponse(
        mode="auto", workers=[worker("decode-1", model=model, kernels=KERNELS)]
    )
    text = status_table(response)
    assert f"\n\nmodels:\n  decode-1  {model}\n\nkernels:\n  decode-1  {KERNELS}" in text


def test_the_cli_time_limits_are_flags_with_positive_seconds(capsys):
    from shared.cli.main import parser

    cli = parser()
    assert cli.parse_args(["status"]).timeout == client.STATUS_TIMEOUT_S
    assert cli.parse_args(["status", "--timeout", "0.5"]).timeout == 0.5
    assert cli.parse_args(["up", "--ready-timeout", "900"]).ready_timeout == 900.0
    for argv in (["status", "--timeout", "0"], ["up", "--ready-timeout", "nan"]):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args(argv)
        assert exc.value.code == 2
    assert "positive number of seconds" in capsys.readouterr().err
