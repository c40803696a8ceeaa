"""SeqStatus: one status per sequence, moved only along one table, and only by the engine."""

import ast
from pathlib import Path

import pytest

from shared.engine.seq_status import MOVES, IllegalMove, SeqStatus
from shared.engine.sequence import Sequence
from shared.values.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
S = SeqStatus


def seq() -> Sequence:
    return Sequence("r", [1, 2, 3], SamplingParams(max_tokens=2), None, set(), 64)


def test_every_status_has_a_row_and_finished_ones_go_nowhere():
    assert set(MOVES) == set(SeqStatus)
    assert {s for s in SeqStatus if s.finished} == {
        S.FINISHED_STOPPED,
        S.FINISHED_LENGTH,
        S.FINISHED_ABORTED,
    }
    assert all(MOVES[s] == frozenset() for s in SeqStatus if s.finished)


@pytest.mark.parametrize(
    "path, illegal",
    [
        ([], S.PREEMPTED),  # a waiting sequence never ran
        ([S.WAITING_KV], S.RUNNING),  # its KV has not landed
        ([S.WAITING_KV, S.KV_READY, S.RUNNING], S.WAITING),  # a running one is preempted first
        ([S.RUNNING, S.FINISHED_LENGTH], S.RUNNING),  # finished is final
        ([S.RUNNING, S.FINISHED_ABORTED], S.FINISHED_STOPPED),  # one reason only
        ([S.RUNNING, S.PREEMPTED], S.RUNNING),  # its blocks first
    ],
)
def test_an_illegal_move_raises_and_leaves_the_status(path, illegal):
    s = seq()
    for status in path:
        s.move(status)
    before = s.status
    with pytest.raises(IllegalMove, match=f"cannot become {illegal.name}"):
        s.move(illegal)
    assert s.status is before


def test_the_status_is_read_only():
    s = seq()
    with pytest.raises(AttributeError):
        s.status = S.RUNNING


def test_why_it_finished_is_its_status():
    s = seq()
    assert s.append(7).finished is None and s.status is S.WAITING
    out = s.append(8)  # max_tokens
    assert out.finished is S.FINISHED_LENGTH and s.status is S.FINISHED_LENGTH
    stopped = Sequence("r", [1], SamplingParams(max_tokens=9), None, {2}, 64)
    assert stopped.append(2).finished is S.FINISHED_STOPPED


def test_no_status_moves_outside_the_engine():
    """Only shared/engine/ moves a SeqStatus: nothing else calls `move(SeqStatus...)` or assigns
    a status."""
    found = []
    for path in sorted([*(ROOT / "shared").rglob("*.py"), *(ROOT / "services").rglob("*.py")]):
        if (ROOT / "shared" / "engine") not in path.parents:
            found += [f"{path.relative_to(ROOT)}:{n}" for n in status_moves(path.read_text())]
    assert found == []


def status_moves(source: str) -> list[int]:
    """The lines of `source` that move a SeqStatus or assign one to a status."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "move":
            lines += [node.lineno] if "SeqStatus" in ast.unparse(node) else []
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            named = any(getattr(t, "attr", "") in ("status", "_status") for t in targets)
            lines += [node.lineno] if named and "SeqStatus" in ast.unparse(node.value) else []
    return lines


def test_the_check_catches_a_move_and_an_assignment():
    bad = "req.seq.status = SeqStatus.WAITING_KV\nreq.seq.move(SeqStatus.RUNNING)\nx.move(1)\n"
    assert status_moves(bad) == [1, 2]
