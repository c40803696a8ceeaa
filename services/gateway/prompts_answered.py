"""The responses to an OpenAI request's prompts: one, or a completion's several (lm-eval sends a
batch of prompts in one request).

Each prompt after the first is a request of its own, in a seat of its own (it counts against
its client's limits as a request does; a seat refused fails the whole answer with that status),
and all are served at once. Their responses come as they are produced, each choice numbered
after the previous prompt's: prompt i's choice j is choice i * n + j, as OpenAI numbers them.
"""

import contextlib

from services.gateway.merge import merged
from services.gateway.openai_request import OpenAIRequest
from shared.api import tandem_pb2 as pb

MAX_ID = 120  # of the request id the prompts after the first extend with "-<i>" (at most 128)


def answers(servicer, req: OpenAIRequest, request_id: str, context, seat):
    """The responses to every prompt of `req` (an async generator); the first prompt's in
    `seat`. One prompt's are its Generate's own (no generator between them and the caller)."""
    first, *more = req.requests
    first.request_id = request_id
    if not more:  # a chat's tool calls stream from openai_format, not the last response
        return servicer.Generate(first, context, context.api, seat, False)
    return _several(servicer, first, more, request_id, context, seat)


async def _several(servicer, first, more, request_id: str, context, seat):
    n = max(1, first.sampling.n)
    streams = [servicer.Generate(first, context, context.api, seat)]
    for i, each in enumerate(more, 1):
        each.request_id = f"{request_id[:MAX_ID]}-{i}"
        streams.append(_seated(servicer, each, context))
    async with contextlib.aclosing(merged(streams)) as tagged:
        async for i, response in tagged:
            response.index += i * n
            yield response


async def _seated(servicer, request: pb.GenerateRequest, context):
    async with servicer.seated(context) as seat:
        generating = servicer.Generate(request, context, context.api, seat)
        async with contextlib.aclosing(generating) as responses:
            async for response in responses:
                yield response
