"""Streams under a fault: requests streamed in threads, each through a gateway, started one at a
time (the next once the last streams, and a heartbeat later) so that every scheduler replica knows
where the others are before it places the next, and they spread over the decode workers; when each
response arrived, to measure how long the fault stalled them."""

import concurrent.futures
import time

from shared.api import tandem_pb2 as pb
from tests.integration.stack import Stack

HEARTBEAT_S = 0.6  # a worker's heartbeat interval (0.5 s), and a little


def running(gateway: Stack) -> dict[str, int]:
    """Sequences running or queued on each worker, by worker id."""
    return {w.id: w.running + w.queued for w in gateway.status().workers}


class Streams:
    def __init__(self, requests: list[tuple[Stack, pb.GenerateRequest]]):
        """Streams each request through its gateway."""
        self.requests = [request for _, request in requests]
        self.arrivals: list[list[float]] = [[] for _ in requests]
        self._pool = concurrent.futures.ThreadPoolExecutor(len(requests))
        self._futures = []
        for i, (gateway, request) in enumerate(requests):
            self._futures.append(self._pool.submit(self._run, gateway, i, request))
            self._wait(lambda i=i: self.arrivals[i], f"stream {i} streaming")
            time.sleep(HEARTBEAT_S)

    def _run(self, gateway: Stack, i: int, request: pb.GenerateRequest):
        responses = []
        for response in gateway.stub().Generate(request, timeout=240):
            responses.append(response)
            self.arrivals[i].append(time.monotonic())
        return responses

    def _wait(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"not {what} within {timeout:.0f}s"
            assert not any(f.done() and f.exception() for f in self._futures), [
                f.exception() for f in self._futures if f.done()
            ]
            time.sleep(0.05)

    def in_flight(self) -> int:
        """Streams not ended yet."""
        return sum(not f.done() for f in self._futures)

    def results(self) -> list[list[pb.GenerateResponse]]:
        try:
            return [f.result() for f in self._futures]
        finally:
            self._pool.shutdown()

    def stall_s(self, since: float) -> float:
        """The longest any stream waited, from `since` on, for its next response."""
        gaps = [0.0]
        for times in self.arrivals:
            after = [since] + [t for t in times if t > since]
            gaps += [later - earlier for earlier, later in zip(after, after[1:])]
        return max(gaps)


def check(results, requests: list[pb.GenerateRequest], expected: dict[str, list[int]]) -> int:
    """Every stream is whole and token-identical to its undisturbed run; how many moved."""
    for responses, request in zip(results, requests):
        ids = [t for r in responses for t in r.token_ids]
        prompt = request.messages[0].content
        assert ids == expected[prompt][: request.sampling.max_tokens], (prompt, responses[-1])
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return sum(responses[-1].timing.migrations for responses in results)
