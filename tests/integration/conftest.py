import tempfile
from pathlib import Path

import pytest

from shared.cli.processes import ProcessGroup
from tests.integration.stack import start_nats, start_stack


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
def hf_model(model_dir):
    """The Hugging Face reference, loaded once in the test process."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
