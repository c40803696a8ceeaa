"""The KV data plane: tensors move worker-to-worker over UCX, never through NATS.

The receiving (decode) side owns the destination buffer and posts a tagged receive into it;
the sending (prefill) side sends the packed KV with that tag to the receiver's UCX worker
address. Tags are 64-bit ids chosen by the receiver per transfer, so concurrent transfers
on one endpoint never mix. `InProcessDataPlane` is the fake for unit tests.
"""

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class KVTransferError(Exception):
    """A transfer that did not complete; the request it belonged to fails."""


@dataclass
class TransferCounters:
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_failed: int = 0


class DataPlane(Protocol):
    address: bytes
    counters: TransferCounters

    async def send(self, peer_address: bytes, tag: int, buffer: torch.Tensor, timeout: float) -> None: ...

    async def receive(self, tag: int, buffer: torch.Tensor, timeout: float) -> None: ...


def _ucx_view(tensor: torch.Tensor):
    """What ucxx accepts: host memory through the array interface, CUDA memory through its own."""
    if not tensor.is_contiguous():
        raise ValueError("KV buffers must be contiguous")
    # Bytes, not elements: numpy has no bfloat16.
    return tensor if tensor.is_cuda else tensor.reshape(-1).view(torch.uint8).numpy()


class UcxDataPlane:
    """The real data plane over ucxx. `async with UcxDataPlane(net_devices, tls) as plane:`."""

    def __init__(self, net_devices: str = "lo", tls: str = ""):
        self._options = {"NET_DEVICES": net_devices}
        if tls:
            self._options["TLS"] = tls
        self._endpoints: dict[bytes, object] = {}
        self._connecting: dict[bytes, asyncio.Lock] = {}
        # ucxx cannot cancel one posted request: a receive whose sender died stays posted, and a
        # send that timed out may still be read; their buffers must outlive them. Only failures
        # land here (a cancelled receive is left to complete, see DecodeWorker._receive).
        self._abandoned: list[torch.Tensor] = []
        self.counters = TransferCounters()
        self.address = b""

    async def __aenter__(self) -> "UcxDataPlane":
        import ucxx

        self._ucxx = ucxx
        ucxx.init(options=self._options, env_takes_precedence=True)
        self.address = ucxx.get_worker_address().tobytes()
        log.info("UCX data plane up: UCX %s, options %s, transports %s",
                 ".".join(map(str, ucxx.get_ucx_version())), self._options,
                 _active_transports(ucxx))
        return self

    async def __aexit__(self, *exc) -> None:
        for ep in self._endpoints.values():
            try:
                await ep.close()
            except Exception as err:  # a peer that is gone already
                log.debug("closing a UCX endpoint: %s", err)
        self._endpoints.clear()
        if self._abandoned:
            log.warning("%d abandoned KV receive buffer(s) at shutdown", len(self._abandoned))

    def _abandon(self, buffer: torch.Tensor) -> None:
        self._abandoned.append(buffer)
        log.warning("KV buffer of %d bytes kept alive for a UCX request that may still use it (%d held)",
                    buffer.numel() * buffer.element_size(), len(self._abandoned))

    async def _endpoint(self, peer_address: bytes):
        ep = self._endpoints.get(peer_address)
        if ep is not None and not ep.closed:
            return ep
        lock = self._connecting.setdefault(peer_address, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(peer_address)
            if ep is None or ep.closed:
                from ucxx._lib.libucxx import UCXAddress

                address = UCXAddress.create_from_buffer(peer_address)
                ep = await self._ucxx.create_endpoint_from_worker_address(address)
                self._endpoints[peer_address] = ep
            return ep

    async def send(self, peer_address: bytes, tag: int, buffer: torch.Tensor, timeout: float) -> None:
        try:
            ep = await self._endpoint(peer_address)
            await asyncio.wait_for(ep.send(_ucx_view(buffer), tag=tag, force_tag=True), timeout)
        except Exception as err:
            self.counters.transfers_failed += 1
            self._abandon(buffer)  # UCX may still be reading it
            self._endpoints.pop(peer_address, None)  # reopened on the next transfer
            raise KVTransferError(f"KV send (tag {tag:#x}) failed: {err!r}") from err
        self.counters.bytes_sent += buffer.numel() * buffer.element_size()

    async def receive(self, tag: int, buffer: torch.Tensor, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._ucxx.recv(_ucx_view(buffer), tag=tag), timeout)
        except BaseException as err:  # cancelled too: the posted receive may still write into it
            self.counters.transfers_failed += 1
            self._abandon(buffer)
            if isinstance(err, asyncio.CancelledError):
                raise
            raise KVTransferError(f"KV receive (tag {tag:#x}) failed: {err!r}") from err
        self.counters.bytes_received += buffer.numel() * buffer.element_size()


def _active_transports(ucxx) -> str:
    try:
        return str(ucxx.get_active_transports())
    except Exception as err:  # older ucxx builds lack it
        return f"unknown ({err})"


class LoopbackNetwork:
    """Connects InProcessDataPlanes of one process to one another (unit tests)."""

    def __init__(self) -> None:
        self.planes: dict[bytes, "InProcessDataPlane"] = {}


class InProcessDataPlane:
    """The test fake: same contract as UcxDataPlane, bytes copied in-process."""

    def __init__(self, network: LoopbackNetwork, name: str):
        self.address = name.encode()
        self.counters = TransferCounters()
        self._network = network
        self._arrived: dict[int, asyncio.Future] = {}
        network.planes[self.address] = self

    def _slot(self, tag: int) -> asyncio.Future:
        return self._arrived.setdefault(tag, asyncio.get_running_loop().create_future())

    async def send(self, peer_address: bytes, tag: int, buffer: torch.Tensor, timeout: float) -> None:
        peer = self._network.planes.get(peer_address)
        if peer is None:
            self.counters.transfers_failed += 1
            raise KVTransferError("unknown peer")
        peer._slot(tag).set_result(buffer.clone())
        self.counters.bytes_sent += buffer.numel() * buffer.element_size()

    async def receive(self, tag: int, buffer: torch.Tensor, timeout: float) -> None:
        try:
            data = await asyncio.wait_for(self._slot(tag), timeout)
        except asyncio.TimeoutError:
            self.counters.transfers_failed += 1
            raise KVTransferError(f"KV receive (tag {tag:#x}) timed out") from None
        finally:
            self._arrived.pop(tag, None)
        if data.shape != buffer.shape or data.dtype != buffer.dtype:
            self.counters.transfers_failed += 1
            raise KVTransferError("KV size mismatch")
        buffer.copy_(data)
        self.counters.bytes_received += buffer.numel() * buffer.element_size()
