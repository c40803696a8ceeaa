"""The fastest row count kept on disk: timed once, read back while nothing that decides it
changed, timed again when something did or the file is unusable."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shared.engine import row_timing
from shared.engine.projection import Projection
from shared.engine.row_timing import cached_fastest_row_count, timing_key


@pytest.fixture
def projections():
    torch.manual_seed(0)
    return [Projection([nn.Linear(64, 96)]), Projection([nn.Linear(96, 64), nn.Linear(96, 32)])]


@pytest.fixture
def timed(monkeypatch):
    """Records the timings; each answers 2 where 2 is a candidate (as the real one answers the only
    candidate when there is one)."""
    calls = []

    def fake(projections, candidates):
        calls.append(list(candidates))
        return 2 if 2 in candidates else candidates[0]

    monkeypatch.setattr(row_timing, "fastest_row_count", fake)
    return calls


def test_timed_once_then_read_back(projections, timed, tmp_path):
    path = tmp_path / "cache" / "row-timing.json"
    assert cached_fastest_row_count(projections, [1, 2, 4], path) == 2
    assert cached_fastest_row_count(projections, [1, 2, 4], path) == 2
    assert timed == [[1, 2, 4]]
    assert json.loads(path.read_text()) == {timing_key(projections, [1, 2, 4]): 2}


def test_other_threads_candidates_or_shapes_are_timed_again(projections, timed, tmp_path):
    path = tmp_path / "row-timing.json"
    cached_fastest_row_count(projections, [1, 2, 4], path)
    cached_fastest_row_count(projections, [2, 4], path)
    cached_fastest_row_count(projections[:1], [1, 2, 4], path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        cached_fastest_row_count(projections, [1, 2, 4], path)
    finally:
        torch.set_num_threads(threads)
    assert len(timed) == 4 and len(json.loads(path.read_text())) == 4


@pytest.mark.parametrize(
    "content", ["not json", "[1, 2]", '{"KEY": "4"}', '{"KEY": 3}', '{"KEY": true}']
)
def test_an_unusable_file_or_entry_is_timed_again(projections, timed, tmp_path, content):
    path = tmp_path / "row-timing.json"
    path.write_text(content.replace("KEY", timing_key(projections, [1, 2, 4])))
    assert cached_fastest_row_count(projections, [1, 2, 4], path) == 2
    assert timed == [[1, 2, 4]]
    assert json.loads(path.read_text())[timing_key(projections, [1, 2, 4])] == 2


def test_nothing_kept_without_a_path_or_a_choice(projections, timed, tmp_path):
    assert cached_fastest_row_count(projections, [1, 2, 4], None) == 2
    assert cached_fastest_row_count(projections, [4], tmp_path / "row-timing.json") == 4
    assert timed == [[1, 2, 4], [4]] and not (tmp_path / "row-timing.json").exists()


def test_the_file_keeps_the_newest_entries(projections, timed, tmp_path, monkeypatch):
    monkeypatch.setattr(row_timing, "MAX_ENTRIES", 2)
    path = tmp_path / "row-timing.json"
    for candidates in ([1, 2], [1, 2, 3], [1, 2, 4]):
        cached_fastest_row_count(projections, candidates, path)
    assert list(json.loads(path.read_text())) == [
        timing_key(projections, [1, 2, 3]),
        timing_key(projections, [1, 2, 4]),
    ]


def test_the_real_timing_answers_a_candidate(projections, tmp_path):
    path = tmp_path / "row-timing.json"
    rows = cached_fastest_row_count(projections, [1, 2, 4], path)
    assert rows in (1, 2, 4) and json.loads(path.read_text()) == {
        timing_key(projections, [1, 2, 4]): rows
    }


def test_the_timing_file_is_a_setting_for_a_read_only_model_cache():
    """A container's baked-in /models is read-only: the timing is kept in /tmp instead."""
    from shared.worker.runtime import row_timing_path
    from shared.worker.settings import WorkerSettings

    assert row_timing_path(WorkerSettings(model_cache="/models")) == Path("/models/row-timing.json")
    kept = WorkerSettings(model_cache="/models", row_timing_file="/tmp/row-timing.json")
    assert row_timing_path(kept) == Path("/tmp/row-timing.json")
