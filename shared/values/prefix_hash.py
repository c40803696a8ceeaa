"""Prefix hashing: a full KV block's content hash, chained over the prefix before it. The engine's
BlockManager keys its prefix cache by it; workers announce a summary of the keys they hold, and the
scheduler service hashes a prompt the same way to estimate a cache hit without asking."""

import hashlib


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return digest.digest()


def summary_key(block_hash: bytes) -> int:
    """The 64-bit form of a block hash that workers announce in their prefix-cache summary."""
    return int.from_bytes(block_hash[:8], "little")


def granule_keys(tokens: list[int], block_size: int, granularity: int) -> list[int]:
    """The summary keys of `tokens`' usable prefix granules, in order: what a worker whose cache
    holds the first k of them would serve from cache (k * granularity tokens). Mirrors
    BlockManager._prefix_hits, so the scheduler can estimate a hit without asking."""
    keys, parent = [], b""
    usable = ((len(tokens) - 1) // granularity) * granularity
    for start in range(0, usable, block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        if (start + block_size) % granularity == 0:
            keys.append(summary_key(parent))
    return keys
