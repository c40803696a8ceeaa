"""The choices of a request that asks for n > 1.

The prompt is computed once; at its first token the decode worker forks it into n sequences that
share the prompt's KV blocks. From then on each choice is a request of its own: it streams under
an attempt id of its own (choice 0 under the request's) and samples with a seed of its own (the
request's seed + its index), so a request with n = 1 and that seed gives the same choice, and a
choice whose worker fails moves on alone.
"""

import dataclasses

from shared.control.messages import GenerateTask, SamplingParams

SEED_SPACE = 1 << 64


def choice_id(attempt_id: str, index: int) -> str:
    return attempt_id if index == 0 else f"{attempt_id}~{index}"


def choice_ids(task: GenerateTask) -> list[str]:
    return [choice_id(task.attempt_id, i) for i in range(task.sampling.n)]


def choice_sampling(params: SamplingParams, index: int) -> SamplingParams:
    """How choice `index` samples: alone (n = 1), with the request's seed + index."""
    seed = (params.seed + index) % SEED_SPACE
    return dataclasses.replace(params, n=1, seed=seed, stop=list(params.stop))


def choice_task(task: GenerateTask, index: int) -> GenerateTask:
    """Choice `index` of a request as a request of its own: its id, its sampling."""
    return dataclasses.replace(
        task,
        attempt_id=choice_id(task.attempt_id, index),
        sampling=choice_sampling(task.sampling, index),
    )
