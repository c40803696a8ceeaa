import tempfile
from pathlib import Path

import pytest

from shared.cli.processes import ProcessGroup
from tests.integration.stack import AUTO_GATEWAY_ID, start_nats, start_stack


@pytest.fixture(scope="session")
def processes(model_dir):
    with ProcessGroup(Path(tempfile.mkdtemp(prefix="tandem-test-logs-"))) as group:
        yield group


@pytest.fixture(scope="session")
def nats(processes):
    return start_nats(processes)


@pytest.fixture(scope="session")
def disagg(processes, nats):
    return start_stack(processes, nats, "it-disagg", "disaggregated")


@pytest.fixture(scope="session")
def colocated(processes, nats, disagg):
    return start_stack(processes, nats, "it-colo", "colocated")


@pytest.fixture(scope="session")
def auto(processes, nats):
    """An auto-mode stack (1 prefill, 1 decode worker) that prefills prompts under 64 tokens on
    the decode worker, takes prompts of up to 512 tokens and answers at most 4: the hostile
    tests' target, and the routing test's. Its gateway's id is fixed, so the hostile tests can
    flood its token subject."""
    return start_stack(
        processes,
        nats,
        "it-auto",
        "auto",
        extra_env={
            "TANDEM_GATEWAY_ID": AUTO_GATEWAY_ID,
            "TANDEM_MAX_TOKENS_LIMIT": "4",
            "TANDEM_DEFAULT_MAX_TOKENS": "4",
            "TANDEM_LOCAL_PREFILL_TOKENS": "64",
            "TANDEM_MAX_PROMPT_TOKENS": "512",
        },
    )


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The Hugging Face reference, loaded once in the test process."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
