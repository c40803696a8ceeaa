"""Shared fixtures: the model is converted once per session; stacks are real processes."""

import os

import pytest

from shared import model_store

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL_CACHE = os.environ.get("TANDEM_MODEL_CACHE", "~/.cache/tandem/models")


@pytest.fixture(scope="session")
def model_dir():
    return model_store.prepare("", MODEL_CACHE)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return model_store.load_tokenizer(model_dir)
