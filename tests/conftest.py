"""Shared fixtures: the model is converted once per session; stacks are real processes."""

import os

# Triton kernels (the CUDA attention) run in Triton's interpreter on CPU: set before anything
# imports triton (torch may), as its own jitted library functions are made at its import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shared import model_store  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL_CACHE = os.environ.get("TANDEM_MODEL_CACHE", "~/.cache/tandem/models")


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist still runs
def pytest_xdist_make_scheduler(config, log):
    """Under xdist (`make test` runs `-n 2`) the integration tests are one unit of work: one worker
    runs them one after another, as without xdist (they start real services, and their timing
    bounds assume the machine to themselves), while the other runs the unit tests."""
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "integration" if nodeid.startswith("tests/integration/") else nodeid

    return IntegrationTogether(config, log)


@pytest.fixture(scope="session")
def model_dir():
    return model_store.prepare("", MODEL_CACHE)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return model_store.load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory, model_dir):
    """family_checkpoint(name) -> the directory of harness/families.py's variant `name`, built
    once per session (random weights, SmolLM2's tokenizer)."""
    from harness import families

    root = tmp_path_factory.mktemp("families")
    return lambda name: families.build(name, root, model_dir)
