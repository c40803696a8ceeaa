"""BlockManager: the paged KV cache's blocks — free list, reference counts, prefix hashing, LRU eviction.

Pure bookkeeping, no tensors: a sequence owns a block table (block ids); the KVPool holds the
bytes. Every full block is content-hashed, chained over the prefix, so a new prompt that starts
like a cached one reuses its blocks. A block whose last holder leaves stays cached (reference
count 0) until it is evicted, least recently freed first, to make room.

Prefix hits are used in whole `cache_granularity`-token units (a multiple of the block size):
the engine computes prompts in fixed chunks of that size, so a sequence that reuses cached
blocks computes exactly what it would have computed without them (bit-identical outputs).
"""

from collections import OrderedDict
from typing import Protocol

from shared.values.prefix_hash import chain_hash, summary_key


class Paged(Protocol):
    """What the BlockManager needs of a sequence."""

    block_table: list[int]
    num_cached_tokens: int
    num_hashed_blocks: int  # leading blocks whose hash is known (registered or reused)
    last_block_hash: bytes  # the chained hash of the last of those

    @property
    def reuses_prefix(self) -> bool: ...  # False: every token computed, none from the cache

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cache_granularity: int | None = None,
        cacheable_tokens: int | None = None,
    ):
        """`cacheable_tokens`: prefix caching only for sequences of at most this many tokens (a
        rope whose frequencies depend on the sequence's length computes longer ones otherwise)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.granularity = cache_granularity or block_size
        self.cacheable_tokens = cacheable_tokens
        if self.granularity % block_size:
            raise ValueError("cache_granularity must be a multiple of block_size")
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Blocks no sequence holds, least recently freed first. Cached ones keep their hash.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # 1 where a block is free and caches no prefix: where a run of new blocks may go. Found
        # with bytes.find (C): a Python scan of the pool cost ~1 ms an allocation at 10k blocks.
        self.usable = bytearray(b"\x01") * num_blocks
        # Hashes of cached blocks that end a whole granule, oldest first: the prefix-cache summary.
        self.granule_ends: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0  # tokens served from the prefix cache
        self.lookups = 0  # prompt tokens looked up

    # -- capacity ----------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return len(self.free_blocks)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def cached(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return sum(1 for b in self.free_blocks if self.block_hash[b] is not None)

    def blocks_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError("num_tokens must not be negative")
        return -(-num_tokens // self.block_size)

    # -- allocate / deallocate ---------------------------------------------------------------

    def _hits_of(self, seq: Paged) -> list[int]:
        return self._prefix_hits(seq.token_ids) if seq.reuses_prefix else []

    def _prefix_hits(self, tokens: list[int]) -> list[int]:
        """Cached blocks that hold the longest usable prefix of `tokens` (whole granules only;
        the last token is never taken from cache, so there is always something to compute)."""
        hits, parent = [], b""
        if not self._cacheable(len(tokens)):
            return hits
        usable = ((len(tokens) - 1) // self.granularity) * self.granularity
        for start in range(0, usable, self.block_size):
            parent = chain_hash(parent, tokens[start : start + self.block_size])
            block = self.hash_to_block.get(parent)
            if block is None:
                break
            hits.append(block)
        per_granule = self.granularity // self.block_size
        return hits[: len(hits) // per_granule * per_granule]

    def can_allocate(self, seq: Paged) -> bool:
        hits = self._hits_of(seq)
        reclaimed = sum(1 for b in hits if self.ref_count[b] == 0)  # hits that are free now
        return self.blocks_for(seq.num_tokens) - len(hits) <= self.free - reclaimed

    def allocate(self, seq: Paged) -> None:
        """A block table for all of seq's tokens, reusing cached prefix blocks."""
        if seq.block_table:
            raise ValueError("sequence already holds blocks")
        if not self.can_allocate(seq):
            raise MemoryError(f"{self.blocks_for(seq.num_tokens)} blocks needed, {self.free} free")
        hits = self._hits_of(seq)
        for block in hits:
            self._take(block)
            # a hit keeps its granule in the summary
            if self.block_hash[block] in self.granule_ends:
                self.granule_ends.move_to_end(self.block_hash[block])
        seq.block_table = hits + self._take_run(
            self.blocks_for(seq.num_tokens) - len(hits), hits[-1] if hits else None
        )
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = self.block_hash[hits[-1]] if hits else b""
        self.hits += seq.num_cached_tokens
        self.lookups += seq.num_tokens

    def deallocate(self, seq: Paged) -> None:
        """Releases seq's blocks; freeing twice is harmless. Full blocks stay cached."""
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0
        seq.last_block_hash = b""

    def release_blocks(self, blocks: list[int]) -> None:
        """Drops one reference to each block (a table no sequence holds any more, such as a
        quarantined transfer's); full blocks stay cached."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks[block] = None
                self.usable[block] = self.block_hash[block] is None

    def fork(self, parent: Paged, child: Paged) -> tuple[int, int] | None:
        """Gives `child` the parent's KV: its full blocks shared, its last block (partly filled,
        so the next tokens of each would collide) copied into one of the child's own. Returns
        (source, copy) of the block whose KV the caller copies (None: no partial block).
        MemoryError, with nothing taken, when no block is free for the copy."""
        if child.block_table:
            raise ValueError("sequence already holds blocks")
        full = parent.num_tokens // self.block_size
        partial = len(parent.block_table) > full
        if partial and not self.free:
            raise MemoryError("no free KV block for a forked sequence's last block")
        for block in parent.block_table[:full]:
            self._take(block)
        child.block_table = parent.block_table[:full]
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        child.last_block_hash = parent.last_block_hash
        if not partial:
            return None
        copy = self._take_run(1, parent.block_table[full])[0]  # no scan of the pool
        child.block_table = child.block_table + [copy]
        return parent.block_table[full], copy

    def leaked(self, live_tables: list[list[int]]) -> int:
        """Blocks held beyond what the given live block tables account for: lost until a restart,
        so this must stay 0. Call under the engine lock."""
        expected = [0] * self.num_blocks
        for table in live_tables:
            for block in table:
                expected[block] += 1
        return sum(1 for block, count in enumerate(self.ref_count) if count > expected[block])

    def can_append(self, seq: Paged) -> bool:
        """Room for seq's tokens as they are now (one more block when a block boundary is crossed)."""
        return self.blocks_for(seq.num_tokens) - len(seq.block_table) <= self.free

    def may_append(self, seq: Paged) -> None:
        while len(seq.block_table) < self.blocks_for(seq.num_tokens):
            seq.block_table += self._take_run(1, seq.block_table[-1] if seq.block_table else None)

    def commit(self, seq: Paged, num_computed_tokens: int) -> None:
        """Registers the hashes of seq's blocks that are full and computed, for later reuse."""
        if not self._cacheable(seq.num_tokens):
            return
        for index in range(seq.num_hashed_blocks, num_computed_tokens // self.block_size):
            start = index * self.block_size
            seq.last_block_hash = chain_hash(
                seq.last_block_hash, seq.token_ids[start : start + self.block_size]
            )
            seq.num_hashed_blocks = index + 1
            block = seq.block_table[index]
            if self.block_hash[block] is None and seq.last_block_hash not in self.hash_to_block:
                self.block_hash[block] = seq.last_block_hash
                self.hash_to_block[seq.last_block_hash] = block
                if (index + 1) * self.block_size % self.granularity == 0:
                    self.granule_ends[seq.last_block_hash] = None

    def prefix_summary(self, limit: int) -> list[int]:
        """Summary keys of the newest `limit` cached granule ends (see granule_keys)."""
        keys = list(self.granule_ends)[-limit:] if limit > 0 else []
        return [summary_key(h) for h in keys]

    # -- internals -----------------------------------------------------------------------------

    def _cacheable(self, num_tokens: int) -> bool:
        return self.cacheable_tokens is None or num_tokens <= self.cacheable_tokens

    def _take_run(self, count: int, after: int | None) -> list[int]:
        """`count` free blocks: consecutive ones (right after `after` if possible) when free and not
        caching a prefix, so attention can read the pool in place; otherwise least recently freed."""
        start = self._find_run(count, after)
        if start is None:
            return [self._take_free() for _ in range(count)]
        for block in range(start, start + count):
            del self.free_blocks[block]
            self.ref_count[block] = 1
        self.usable[start : start + count] = bytes(count)
        return list(range(start, start + count))

    def _find_run(self, count: int, after: int | None) -> int | None:
        """The first block of the lowest run of `count` usable blocks (right after `after` when
        that run is usable); None when there is none."""
        if count == 0:
            return None
        run = b"\x01" * count
        if after is not None and self.usable[after + 1 : after + 1 + count] == run:
            return after + 1
        if count == 1 and after is not None:
            return None  # growing by one block: not worth a scan
        start = self.usable.find(run)
        return None if start < 0 else start

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free_blocks[block]
            self.usable[block] = 0
        self.ref_count[block] += 1

    def _take_free(self) -> int:
        if not self.free_blocks:
            raise MemoryError("no free KV block")
        block, _ = self.free_blocks.popitem(last=False)  # least recently freed: evict its prefix
        self.usable[block] = 0
        if self.block_hash[block] is not None:
            del self.hash_to_block[self.block_hash[block]]
            self.granule_ends.pop(self.block_hash[block], None)
            self.block_hash[block] = None
        self.ref_count[block] = 1
        return block
