"""Forking a sequence into the choices of its request (sampling.n > 1), at its first token.

The prompt was computed once; each other choice gets a Sequence of its own that shares the
prompt's full KV blocks and has its own copy of the last, partly filled one (the choices' next
tokens land there, and differ): copy-on-write at the first block where they diverge. A choice
for which no block is free for that copy computes the prompt again later, like a preempted
sequence: correct, only not shared.
"""

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence
from shared.engine.step_runner import StepRunner
from shared.values.sampling import choice_id, choice_sampling


def fork(
    seq: Sequence, n: int, blocks: BlockManager, runner: StepRunner
) -> list[tuple[Sequence, bool]]:
    """Choices 1..n-1 of seq's request, each with whether it shares seq's KV (else it must
    compute its prompt again); seq becomes choice 0. Call under the engine lock, before seq
    takes its first token. A failure midway gives back what the children took."""
    group, params, children = seq.attempt_id, seq.sampling, []
    try:
        for index in range(1, n):
            child = seq.fork(choice_id(group, index), choice_sampling(params, index), index)
            children.append((child, _share(seq, child, blocks, runner)))
    except BaseException:
        for child, _ in children:
            blocks.deallocate(child)
        raise
    seq.rename(choice_id(group, 0), choice_sampling(params, 0))
    return children


def _share(seq: Sequence, child: Sequence, blocks: BlockManager, runner: StepRunner) -> bool:
    try:
        copy = blocks.fork(seq, child)
    except MemoryError:
        child.num_computed_tokens = 0
        return False
    if copy is not None:
        try:
            runner.copy_block(*copy)
        except BaseException:
            blocks.deallocate(child)
            raise
    return True
