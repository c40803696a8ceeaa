"""Runs the model: a prompt forward pass that builds the KV cache, and one-token decode steps.

Blocking torch code: callers run it off the event loop (see EngineExecutor).
"""

import asyncio
import concurrent.futures
from typing import Callable, TypeVar

import torch
from transformers import DynamicCache

from shared.engine import kv_cache
from shared.messages import KVLayout

R = TypeVar("R")


class ModelRunner:
    def __init__(self, model, model_name: str, device: str):
        self.model = model
        self.device = device
        self.config = model.config
        self.layout: KVLayout = kv_cache.layout_of(model.config, model_name, model.dtype)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
        """The prompt's KV cache and the logits [vocab] at its last position."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.config)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[0, -1].float()

    @torch.inference_mode()
    def decode(self, cache: DynamicCache, token_id: int) -> torch.Tensor:
        """Appends token_id to the cache; returns the logits [vocab] for the next position."""
        ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True)
        return out.logits[0, -1].float()

    def pack(self, cache: DynamicCache) -> torch.Tensor:
        return kv_cache.pack(cache, self.layout, self.device)

    def unpack(self, buffer: torch.Tensor) -> DynamicCache:
        return kv_cache.unpack(buffer, self.config)

    def empty_kv(self, num_tokens: int) -> torch.Tensor:
        return kv_cache.empty_buffer(self.layout, num_tokens, self.device)


class EngineExecutor:
    """One thread for the model, so the event loop keeps serving NATS and UCX while it computes."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def run(self, fn: Callable[..., R], *args) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
