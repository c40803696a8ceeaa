"""Fakes for the serving-benchmark tests: a word tokenizer and an in-process gateway."""

import asyncio
import re
import threading
from dataclasses import dataclass, field

import grpc

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc

LETTERS = "abcdefghij"


class WordTokenizer:
    """' word' is one token and a leading BOS is added with add_special_tokens, except that a word
    repeated right after itself merges with it into one token: so a prompt of random words does
    not always count one token a word, and PromptBuilder.fit has to correct it."""

    def __init__(self, words: int = 80):
        self.vocab = ["<s>", "<unk>"] + [" " + a + b for a in LETTERS for b in LETTERS][:words]
        self.ids = {text: i for i, text in enumerate(self.vocab)}

    def __len__(self) -> int:
        return len(self.vocab)

    def __call__(self, text, add_special_tokens: bool = True) -> dict:
        if isinstance(text, list):
            return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [0] if add_special_tokens else []
        previous = None
        for piece in re.findall(r" ?[^ ]+", text):
            if piece != previous:
                ids.append(self.ids.get(piece, 1))
            previous = None if piece == previous else piece
        return ids

    def batch_decode(self, batch: list[list[int]]) -> list[str]:
        return ["".join(self.vocab[i] for i in ids) for ids in batch]


@dataclass
class Behaviour:
    first_token_s: float = 0.2  # wait before the first token
    gap_s: float = 0.01  # wait before each later chunk
    chunk_tokens: int = 2  # tokens in each later chunk
    fail_every: int = 0  # every n-th request (by request id number) is refused
    in_flight: int = 0
    max_in_flight: int = 0
    received: list = field(default_factory=list)


class FakeTandem(pb_grpc.TandemServicer):
    def __init__(self, behaviour: Behaviour):
        self.b = behaviour

    async def Generate(self, request: pb.GenerateRequest, context):
        self.b.received.append(request)
        number = int(request.request_id.rsplit("-", 1)[-1])
        if self.b.fail_every and number % self.b.fail_every == self.b.fail_every - 1:
            context.set_trailing_metadata((("retry-after-ms", "250"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "every worker is full")
        self.b.in_flight += 1
        self.b.max_in_flight = max(self.b.max_in_flight, self.b.in_flight)
        try:
            async for response in self._stream(request):
                yield response
        finally:
            self.b.in_flight -= 1

    async def _stream(self, request: pb.GenerateRequest):
        total, sent = request.sampling.max_tokens, 0
        await asyncio.sleep(self.b.first_token_s)
        while sent < total:
            n = 1 if sent == 0 else min(self.b.chunk_tokens, total - sent)
            if sent:
                await asyncio.sleep(self.b.gap_s)
            sent += n
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=list(range(n)), text="x" * n
            )
        yield pb.GenerateResponse(
            request_id=request.request_id,
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(request.prompt.split()), completion_tokens=total),
            timing=pb.Timing(
                queue_ms=1.0, prefill_ms=2.0, ttft_ms=200.0, path="disaggregated", cached_tokens=3
            ),
        )

    async def ClusterStatus(self, request, context):
        return pb.ClusterStatusResponse(
            mode="fake", workers=[pb.WorkerStatus(id="w0", role="decode")]
        )


class FakeGateway:
    """A grpc.aio server with FakeTandem, on its own event loop in a thread, so both async tests
    and the synchronous CLI (which runs its own asyncio.run) can call it."""

    def __init__(self, behaviour: Behaviour | None = None):
        self.behaviour = behaviour or Behaviour()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.address = ""

    def __enter__(self) -> "FakeGateway":
        self.thread.start()
        self.server, port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.address = f"127.0.0.1:{port}"
        return self

    async def _start(self):
        server = grpc.aio.server()
        pb_grpc.add_TandemServicer_to_server(FakeTandem(self.behaviour), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
