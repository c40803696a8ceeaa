"""ucxx's private API is used in one module, which checks that the installed ucxx has all of it."""

import logging
import pathlib
import re
import sys

import pytest

from shared.dataplane import ucxx_compat
from shared.dataplane.ucx import UcxDataPlane
from shared.dataplane.ucxx_compat import IncompatibleUcxx

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_installed_ucxx_is_compatible():
    installed = ucxx_compat.check()
    assert ucxx_compat.parse_version(installed) >= ucxx_compat.MINIMUM
    assert ucxx_compat.missing_names() == []


def test_version_parsing():
    assert ucxx_compat.parse_version("0.52.00") == (0, 52)
    assert ucxx_compat.parse_version("0.45.01") == (0, 45)
    assert ucxx_compat.parse_version("1.0") == (1, 0)


def test_an_old_ucxx_is_refused_by_version(monkeypatch):
    import ucxx

    monkeypatch.setattr(ucxx, "__version__", "0.45.01")
    with pytest.raises(IncompatibleUcxx) as caught:
        ucxx_compat.check()
    message = str(caught.value)
    assert "ucxx 0.45.01 cannot drive the KV data plane" in message
    assert "older than 0.47" in message
    assert "ucxx >=0.47" in message


def test_a_missing_private_name_is_refused_by_name(monkeypatch):
    # ucxx 0.45's progress tasks had no `_tasks`: workers crash-looped on an AttributeError.
    from ucxx._lib_async.continuous_ucx_progress import ProgressTask

    monkeypatch.delattr(ProgressTask, "_tasks")
    with pytest.raises(IncompatibleUcxx) as caught:
        ucxx_compat.check()
    message = str(caught.value)
    assert f"ucxx {ucxx_compat.version()} cannot drive" in message
    assert "missing ucxx._lib_async.continuous_ucx_progress.ProgressTask._tasks" in message
    assert "supported: ucxx >=0.47" in message


def test_a_missing_ucxx_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "ucxx", None)  # import ucxx raises ImportError
    with pytest.raises(IncompatibleUcxx, match="ucxx cannot be imported"):
        ucxx_compat.check()


def test_a_newer_ucxx_is_accepted_with_a_warning(monkeypatch, caplog):
    import ucxx

    monkeypatch.setattr(ucxx, "__version__", "0.99.00")
    with caplog.at_level(logging.WARNING, logger=ucxx_compat.__name__):
        assert ucxx_compat.check() == "0.99.00"
    assert "newer than any tested" in caplog.text


async def test_the_data_plane_refuses_to_start_on_an_incompatible_ucxx(monkeypatch):
    import ucxx

    monkeypatch.setattr(ucxx, "__version__", "0.46.00")
    with pytest.raises(IncompatibleUcxx, match="ucxx 0.46.00 cannot drive"):
        async with UcxDataPlane():
            pass


def test_the_command_line_check(capsys, monkeypatch):
    assert ucxx_compat.main() == 0
    assert "compatible" in capsys.readouterr().out
    import ucxx

    monkeypatch.setattr(ucxx, "__version__", "0.45.01")
    assert ucxx_compat.main() == 1
    assert "ucxx 0.45.01 cannot drive" in capsys.readouterr().err


def test_no_other_module_touches_ucxx_internals():
    private = re.compile(r"ucxx\._|_get_ctx|\._ep\b|ProgressTasks|\b_clear_tasks\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("shared", "services", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "ucxx_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert offenders == []
