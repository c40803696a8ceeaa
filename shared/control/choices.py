"""The choices of a request that asks for n > 1.

The prompt is computed once, under the group's attempt id; at its first token the decode worker
forks it into n sequences that share the prompt's KV blocks (the group's own goes on as choice 0).
From then on each choice is a request of its own: it streams under an attempt id of its own
(`<group id>~<index>`, known from the start, so a choice is cancelled alone and its stream is
there before the fork) and samples with a seed of its own (the request's seed + its index), so a
request with n = 1 and that seed gives the same choice, and a choice whose worker fails moves on
alone.
"""

import dataclasses

from shared.control.messages import GenerateTask
from shared.values.sampling import choice_id, choice_sampling


def choice_ids(task: GenerateTask) -> list[str]:
    """The ids the request's tokens stream under: its own, or (n > 1) each choice's."""
    if task.sampling.n == 1:
        return [task.attempt_id]
    return [choice_id(task.attempt_id, i) for i in range(task.sampling.n)]


def all_ids(task: GenerateTask) -> list[str]:
    """Every id the request may be held under on a worker (what a cancel must name)."""
    return [task.attempt_id] + (choice_ids(task) if task.sampling.n > 1 else [])


def choice_task(task: GenerateTask, index: int) -> GenerateTask:
    """Choice `index` of a request as a request of its own: its id, its sampling."""
    return dataclasses.replace(
        task,
        attempt_id=choice_id(task.attempt_id, index),
        sampling=choice_sampling(task.sampling, index),
    )
