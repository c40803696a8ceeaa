"""A tensor-parallel group stepping in lockstep: rank 0's Engine drives every rank's runner.

Rank 0 holds the group's one block table (its Engine and BlockManager) and steps as a worker
does; `GroupRunner` stands for its ModelRunner: each forward pass, and each block copy a fork
asks of the pool, is sent to the other ranks first, then run here. The other ranks `follow`:
they hold a ModelRunner over their shard and its KV pool, and run what rank 0 sends, until it
says stop. Commands travel on the group's command link (commands.py: int64 frames, never
pickled): for a pass, each span's [table length, start, end, sequence length, prompt] then its
block table and the ids of the tokens it computes; only the all-reduces inside a pass are
collectives.

A pass is never abandoned midway on a rank: every rank must reach every all-reduce, so a step of
cancelled sequences runs to its end. Every collective has the process group's timeout: a rank
that died or hangs fails the group (GroupFailed) instead of hanging it.
"""

from collections.abc import Callable

from shared.engine.forward_batch import SeqSpan
from shared.engine.model_runner import ModelRunner
from shared.engine.step_runner import RunnerLost, StepRunner
from shared.parallel.commands import CommandReader, CommandWriter, GroupGone, Op


def encode_spans(spans: list[SeqSpan]) -> list[int]:
    """Each span as [table length, start, end, sequence length, prompt], its block table, and the
    ids of the tokens it computes, [start, end): a decode step sends one id a sequence, not its
    whole history."""
    out = []
    for s in spans:
        out += [len(s.block_table), s.start, s.end, len(s.token_ids), int(s.prompt)]
        out += s.block_table
        out += s.token_ids[s.start : s.end]
    return out


def decode_spans(payload: list[int]) -> list[SeqSpan]:
    """The spans as rank 0 ran them: the ids they compute where rank 0 has them, and as many in
    all (a length-dependent rope takes its frequencies from the sequence's length); the ids
    before and after are never read."""
    spans, at = [], 0
    while at < len(payload):
        blocks, start, end, length, prompt = payload[at : at + 5]
        at += 5
        table, at = payload[at : at + blocks], at + blocks
        new, at = payload[at : at + end - start], at + end - start
        ids = [0] * start + new + [0] * (length - end)
        spans.append(SeqSpan(table, ids, start, end, bool(prompt)))
    return spans


class GroupFailed(RunnerLost):
    """A rank of the group is gone (or a collective timed out): the group cannot step again."""


class GroupRunner(StepRunner):
    """Rank 0's runner, as its Engine steps it: every call runs on every rank. A rank that died
    (its command link broken, a collective failed or timed out) raises GroupFailed."""

    def __init__(
        self,
        runner: ModelRunner,
        commands: CommandWriter,
        on_failure: Callable[[str], None] = lambda why: None,
    ):
        self.runner, self.commands = runner, commands
        self.chunk, self.rotary, self.kernels = runner.chunk, runner.rotary, runner.kernels
        self.on_failure = on_failure  # told why, before GroupFailed is raised

    def _failed(self, why: str) -> GroupFailed:
        self.on_failure(why)
        return GroupFailed(why)

    def _send(self, op: Op, payload: list[int]) -> None:
        try:
            self.commands.send(op, payload)
        except GroupGone as err:
            raise self._failed(str(err)) from None

    def forward(self, spans: list[SeqSpan], abandon=None):
        self._send(Op.FORWARD, encode_spans(spans))
        try:
            return self.runner.forward(spans)  # never abandoned: the others run the whole pass
        except GroupFailed:
            raise
        except RuntimeError as err:  # gloo: a peer's connection closed, or the timeout ran out
            raise self._failed(f"a collective of the group failed: {err}") from None

    def argmax(self, logits):
        return self.runner.argmax(logits)

    def copy_block(self, source: int, target: int) -> None:
        self._send(Op.COPY_BLOCK, [source, target])
        self.runner.copy_block(source, target)

    def stop(self) -> None:
        """The other ranks leave `follow`."""
        self._send(Op.STOP, [])


def follow(runner: ModelRunner, commands: CommandReader) -> int:
    """A rank other than 0: runs what rank 0 sends until it says stop; the passes it ran.
    GroupGone when rank 0 went away without saying so."""
    passes = 0
    while True:
        op, payload = commands.receive()
        if op is Op.STOP:
            return passes
        if op is Op.COPY_BLOCK:
            runner.copy_block(*payload)
            continue
        runner.forward(decode_spans(payload))
        passes += 1
