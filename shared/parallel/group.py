"""A tensor-parallel group stepping in lockstep: rank 0's Engine drives every rank's runner.

Rank 0 holds the group's one block table (its Engine and BlockManager) and steps as a worker
does; `GroupRunner` stands for its ModelRunner: each forward pass, and each block copy a fork
asks of the pool, is sent to the other ranks first, then run here. The other ranks `follow`:
they hold a ModelRunner over their shard and its KV pool, and run what rank 0 sends, until it
says stop. Commands travel as int64 tensors broadcast from rank 0 (never pickled): a header
[op, length] and, for a pass, each span's [table length, token count, start, end, prompt] then
its block table and token ids.

A pass is never abandoned midway on a rank: every rank must reach every all-reduce, so a step of
cancelled sequences runs to its end. Every collective has the process group's timeout.
"""

import enum

import torch
import torch.distributed as dist

from shared.engine.forward_batch import SeqSpan
from shared.engine.model_runner import ModelRunner


class Op(enum.IntEnum):
    STOP = 0
    FORWARD = 1
    COPY_BLOCK = 2


def _send(op: Op, payload: list[int], group) -> None:
    dist.broadcast(torch.tensor([int(op), len(payload)], dtype=torch.int64), 0, group=group)
    if payload:
        dist.broadcast(torch.tensor(payload, dtype=torch.int64), 0, group=group)


def _receive(group) -> tuple[Op, list[int]]:
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, 0, group=group)
    op, length = Op(int(header[0])), int(header[1])
    payload = torch.empty(length, dtype=torch.int64)
    if length:
        dist.broadcast(payload, 0, group=group)
    return op, payload.tolist()


def encode_spans(spans: list[SeqSpan]) -> list[int]:
    out = []
    for s in spans:
        out += [len(s.block_table), s.end, s.start, s.end, int(s.prompt)]
        out += s.block_table
        out += s.token_ids[: s.end]
    return out


def decode_spans(payload: list[int]) -> list[SeqSpan]:
    spans, at = [], 0
    while at < len(payload):
        blocks, tokens, start, end, prompt = payload[at : at + 5]
        at += 5
        table, at = payload[at : at + blocks], at + blocks
        ids, at = payload[at : at + tokens], at + tokens
        spans.append(SeqSpan(table, ids, start, end, bool(prompt)))
    return spans


class _GroupPool:
    """The pool as a fork sees it: a block copy happens on every rank."""

    def __init__(self, group_runner: "GroupRunner"):
        self.group_runner = group_runner

    def copy_block(self, source: int, target: int) -> None:
        _send(Op.COPY_BLOCK, [source, target], self.group_runner.group)
        self.group_runner.runner.pool.copy_block(source, target)


class GroupRunner:
    """Rank 0's runner, as its Engine steps it: every call runs on every rank."""

    def __init__(self, runner: ModelRunner, group=None):
        self.runner, self.group = runner, group
        self.chunk, self.rotary = runner.chunk, runner.rotary
        self.pool = _GroupPool(self)

    def forward(self, spans: list[SeqSpan], abandon=None):
        _send(Op.FORWARD, encode_spans(spans), self.group)
        return self.runner.forward(spans)  # never abandoned: the others run the whole pass

    def stop(self) -> None:
        """The other ranks leave `follow`."""
        _send(Op.STOP, [], self.group)


def follow(runner: ModelRunner, group=None) -> int:
    """A rank other than 0: runs what rank 0 sends until it says stop; the passes it ran."""
    passes = 0
    while True:
        op, payload = _receive(group)
        if op is Op.STOP:
            return passes
        if op is Op.COPY_BLOCK:
            runner.pool.copy_block(*payload)
            continue
        runner.forward(decode_spans(payload))
        passes += 1
