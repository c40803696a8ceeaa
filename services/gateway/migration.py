"""Moving a request off a worker that failed: the tokens the client has are kept, the rest goes on elsewhere.

A decode worker that dies (or shuts down past its drain time), or a prefill worker that fails a
prompt, does not fail the request: the gateway submits it again as a new attempt whose prompt is
the original prompt plus every token already streamed, with `resume_tokens` saying how many of
those are output. The new decode worker re-prefills that (from its prefix cache where it can),
primes its detokenizer with the output so the text goes on seamlessly, and samples the next
position; greedy output is the same as an undisturbed run's, and seeded sampling is too (each
position's draw depends only on the seed and the position), penalised or not (the tokens sent
count as output for the penalties; max_tokens and min_tokens are lowered by as many). A prefill
worker that turns the prompt away as full has not failed either: the request is placed again,
that worker not avoided.
"""

import dataclasses
import uuid

from shared.control.failure import Failure
from shared.control.messages import GenerateTask

FULL_MOVES = 8  # times a request turned away by a full worker is placed again (a failed one: --max-migrations)


class WorkerLost(Exception):
    """The worker serving a request failed, not the request: its failure is movable. Retry.HERE:
    the worker was full, not broken; it is not avoided next time, and such moves have a limit of
    their own (two schedulers may race for the last place of a worker). Retry.ELSEWHERE: it
    failed (or a chunk was lost, blaming nobody); the next attempt avoids it."""

    def __init__(self, failure: Failure):
        if not failure.movable:
            raise ValueError(f"not a failure to move a request for: {failure}")
        super().__init__(failure.message)
        self.failure = failure


def new_attempt_id(request_id: str) -> str:
    """A new attempt id for the client's request `request_id`: its id and a random part."""
    return f"{request_id}.{uuid.uuid4().hex[:12]}"


def client_id(attempt_id: str) -> str:
    return attempt_id.rsplit(".", 1)[0]


def resumed(
    task: GenerateTask, prompt: list[int], sent: list[int], failed_worker: str
) -> GenerateTask:
    """The next attempt of `task` after `failed_worker` failed it, `sent` being the output the
    client has received (`prompt`, the original prompt)."""
    avoid = task.avoid_workers + (
        [failed_worker] if failed_worker and failed_worker not in task.avoid_workers else []
    )
    sampling = dataclasses.replace(
        task.sampling,
        max_tokens=task.sampling.max_tokens + task.resume_tokens - len(sent),
        min_tokens=max(0, task.sampling.min_tokens + task.resume_tokens - len(sent)),
        stop=list(task.sampling.stop),
        # the client has them with the first token: the prompt is not scored again
        prompt_logprobs=task.sampling.prompt_logprobs and not sent,
    )
    return dataclasses.replace(
        task,
        attempt_id=new_attempt_id(client_id(task.attempt_id)),
        prompt_token_ids=prompt + sent,
        resume_tokens=len(sent),
        sampling=sampling,
        avoid_workers=avoid,
        moves=task.moves + 1,
    )
