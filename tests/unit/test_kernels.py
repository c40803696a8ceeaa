"""Where the CPU kernels are built and found: torch's extension cache, or, where that cannot be
written (an image's under a read-only root filesystem) and has no build for this CPU, the
temporary directory, instead of falling back to plain torch ops."""

import logging
import shutil
import tempfile

import pytest

from shared.engine import kernels


def test_the_build_directory_is_torchs_extension_cache_where_it_can_be_made(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    assert kernels.build_directory("k") == tmp_path / "cache" / "k"


def _unwritable_cache(tmp_path, monkeypatch):
    """A cache that cannot be made even by root: its parent is a file."""
    (tmp_path / "image").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "image" / "kernels"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))


def test_an_unwritable_cache_builds_in_the_temporary_directory_with_a_warning(
    tmp_path, monkeypatch, caplog
):
    _unwritable_cache(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING):
        directory = kernels.build_directory("k")
    assert directory == tmp_path / "tmp" / "tandem-kernels" / "k" and directory.is_dir()
    assert "at every start" in caplog.text


@pytest.mark.slow  # builds the kernels once where no build for this CPU is cached
def test_the_kernels_load_from_the_temporary_directory(tmp_path, monkeypatch):
    """Before, an unwritable cache meant plain torch ops, with a warning."""
    name = kernels.module_name()
    assert kernels.load() is not None  # this CPU's build, in the real cache
    built = kernels.build_directory(name) / f"{name}.so"
    _unwritable_cache(tmp_path, monkeypatch)
    scratch = tmp_path / "tmp" / "tandem-kernels" / name
    scratch.mkdir(parents=True)
    shutil.copy(built, scratch)  # as an earlier start in this container left it
    monkeypatch.setattr(kernels, "_loaded", {})
    module = kernels.load()
    assert module is not None and module.__spec__.origin == str(scratch / f"{name}.so")
