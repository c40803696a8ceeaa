"""Every NATS subject Tandem uses, namespaced by the cluster name."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Subjects:
    cluster: str

    @property
    def _root(self) -> str:
        return f"tandem.{self.cluster}"

    @property
    def heartbeat(self) -> str:
        """Workers announce themselves and their load here."""
        return f"{self._root}.workers.heartbeat"

    @property
    def discover(self) -> str:
        """A scheduler asks every worker to announce itself now."""
        return f"{self._root}.workers.discover"

    @property
    def probe(self) -> str:
        """Nobody subscribes: a request here is answered by the server itself ("no responders"),
        which tells a process whether the server is there (MessageBus.reachable)."""
        return f"{self._root}.probe"

    @property
    def submit(self) -> str:
        """Gateway -> scheduler: a new request (queue group: any scheduler may take it)."""
        return f"{self._root}.scheduler.submit"

    @property
    def scheduler_heartbeat(self) -> str:
        """Schedulers announce themselves here (SchedulerHeartbeat)."""
        return f"{self._root}.scheduler.heartbeat"

    def submit_to(self, scheduler_id: str) -> str:
        """Gateway -> one scheduler replica: a new request, to a replica it watches."""
        return f"{self._root}.scheduler.{scheduler_id}.submit"

    def scheduler_ping(self, scheduler_id: str) -> str:
        """Gateway -> one scheduler: still there? (No responders: its process is gone.)"""
        return f"{self._root}.scheduler.{scheduler_id}.ping"

    @property
    def status(self) -> str:
        """Gateway -> scheduler: which workers are alive."""
        return f"{self._root}.scheduler.status"

    @property
    def cancel(self) -> str:
        """Gateway -> every worker: stop a request and free what it holds."""
        return f"{self._root}.requests.cancel"

    def decode_tasks(self, worker_id: str) -> str:
        """Scheduler -> one decode (or colocated) worker: its assignments. Apart from the prefill
        workers' tasks, so NATS permissions can tell the two roles' work apart."""
        return f"{self._root}.decode.{worker_id}.tasks"

    def stream_replay(self, worker_id: str) -> str:
        """Gateway -> one decode worker: send a stream's chunks again (StreamReplay)."""
        return f"{self._root}.decode.{worker_id}.replay"

    def prefill_tasks(self, worker_id: str) -> str:
        """Decode worker -> one prefill worker: a prompt to compute and send the KV of."""
        return f"{self._root}.prefill.{worker_id}.tasks"

    def prefill_results(self, worker_id: str) -> str:
        """Prefill worker -> decode worker: the prefill of a request is done and its KV is on the wire."""
        return f"{self._root}.worker.{worker_id}.prefill_results"

    def transfer_aborts(self, worker_id: str) -> str:
        """Decode worker -> prefill worker: stop a KV transfer and free its blocks."""
        return f"{self._root}.worker.{worker_id}.transfer_aborts"

    def ping(self, worker_id: str) -> str:
        """Anyone -> one worker: are you still on NATS? (No responders there: its process is gone.)"""
        return f"{self._root}.worker.{worker_id}.ping"

    def gateway_tokens(self, gateway_id: str) -> str:
        """Workers -> one gateway: the token stream chunks of the requests it holds."""
        return f"{self._root}.gateway.{gateway_id}.tokens"

    @property
    def gateway_holdings(self) -> str:
        """Gateway -> every gateway: what its clients hold there (GatewayHoldings)."""
        return f"{self._root}.gateway.holdings"
