"""BlockManager: paged blocks, reference counts, chained prefix hashing, LRU eviction."""

import pytest

from shared.engine.block_manager import BlockManager


class FakeSeq:
    """The Paged protocol, nothing more."""

    def __init__(self, tokens, reuses_prefix: bool = True):
        self.token_ids = list(tokens)
        self.reuses_prefix = reuses_prefix
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_hashed_blocks = 0
        self.last_block_hash = b""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def toks(start: int, n: int) -> list[int]:
    """n distinct-ish token ids starting at `start`."""
    return list(range(start, start + n))


def allocated(bm: BlockManager, tokens, commit: bool = False) -> FakeSeq:
    seq = FakeSeq(tokens)
    bm.allocate(seq)
    if commit:
        bm.commit(seq, seq.num_tokens)
    return seq


# -- construction and sizing -------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)]
)
def test_blocks_for_rounds_up(tokens, blocks):
    assert BlockManager(10, 16).blocks_for(tokens) == blocks


@pytest.mark.parametrize("tokens", [-1, -16, -100])
def test_negative_counts_are_rejected(tokens):
    bm = BlockManager(4, 16)
    with pytest.raises(ValueError):
        bm.blocks_for(tokens)
    assert (bm.used, bm.free) == (0, 4)


@pytest.mark.parametrize("blocks, size", [(0, 16), (10, 0), (-1, 16), (4, -16)])
def test_rejects_non_positive_sizes(blocks, size):
    with pytest.raises(ValueError):
        BlockManager(blocks, size)


@pytest.mark.parametrize("granularity", [8, 24, 40])
def test_cache_granularity_must_be_a_multiple_of_the_block_size(granularity):
    with pytest.raises(ValueError):
        BlockManager(8, 16, cache_granularity=granularity)


def test_cache_granularity_defaults_to_the_block_size():
    assert BlockManager(8, 16).granularity == 16
    assert BlockManager(8, 16, cache_granularity=64).granularity == 64


# -- allocate / deallocate ---------------------------------------------------------------------


def test_allocate_and_deallocate_accounting():
    bm = BlockManager(num_blocks=10, block_size=16)
    a = allocated(bm, toks(0, 40))  # 3 blocks
    b = allocated(bm, toks(100, 16))  # 1 block
    assert (len(a.block_table), len(b.block_table)) == (3, 1)
    assert not set(a.block_table) & set(b.block_table)
    assert (bm.used, bm.free) == (4, 6)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    bm.deallocate(a)
    assert a.block_table == [] and (bm.used, bm.free) == (1, 9)
    bm.deallocate(b)
    assert (bm.used, bm.free) == (0, 10)


def test_exhausted_pool_refuses_and_leaves_state_unchanged():
    bm = BlockManager(4, 16)
    allocated(bm, toks(0, 48))  # 3 of 4 blocks
    big = FakeSeq(toks(100, 17))  # needs 2
    assert not bm.can_allocate(big)
    with pytest.raises(MemoryError):
        bm.allocate(big)
    assert big.block_table == [] and (bm.used, bm.free) == (3, 1)
    last = FakeSeq(toks(200, 16))  # exactly the last block
    assert bm.can_allocate(last)
    bm.allocate(last)
    assert bm.free == 0
    assert not bm.can_allocate(FakeSeq([1]))


def test_allocating_a_sequence_that_holds_blocks_raises():
    bm = BlockManager(10, 16)
    a = allocated(bm, toks(0, 16))
    table = list(a.block_table)
    a.token_ids += toks(50, 48)
    with pytest.raises(ValueError):
        bm.allocate(a)
    assert a.block_table == table and bm.used == 1


def test_deallocate_twice_is_harmless():
    bm = BlockManager(10, 16)
    a = allocated(bm, toks(0, 20))
    b = allocated(bm, toks(100, 20))
    bm.deallocate(a)
    bm.deallocate(a)
    bm.deallocate(FakeSeq(toks(0, 5)))  # never allocated
    assert bm.used == 2 and len(b.block_table) == 2
    assert all(bm.ref_count[block] == 1 for block in b.block_table)
    assert all(count >= 0 for count in bm.ref_count)


# -- reference counts and prefix sharing -------------------------------------------------------


def test_sharing_a_committed_prefix_shares_blocks_until_both_leave():
    bm = BlockManager(16, 16, cache_granularity=32)
    prefix = toks(0, 64)
    a = allocated(bm, prefix + toks(500, 6), commit=True)  # 5 blocks, 4 full ones hashed
    b = allocated(bm, prefix + toks(700, 6))
    assert b.num_cached_tokens == 64 and b.num_hashed_blocks == 4
    assert b.block_table[:4] == a.block_table[:4]
    assert b.block_table[4] != a.block_table[4]
    assert all(bm.ref_count[block] == 2 for block in a.block_table[:4])
    assert bm.used == 6
    shared = a.block_table[:4]
    bm.deallocate(a)
    assert bm.used == 5
    assert all(bm.ref_count[block] == 1 for block in shared)
    assert not any(block in bm.free_blocks for block in shared)
    bm.deallocate(b)
    assert (bm.used, bm.free) == (0, 16)
    assert bm.cached == 4  # the full blocks stay cached; the partial ones do not
    assert bm.hits == 64 and bm.lookups == 140


def test_no_hit_before_the_first_sequence_commits():
    bm = BlockManager(16, 16)
    allocated(bm, toks(0, 40))  # allocated, not computed
    b = allocated(bm, toks(0, 40))
    assert b.num_cached_tokens == 0 and bm.used == 6


def test_commit_registers_only_full_computed_blocks():
    bm = BlockManager(16, 16)
    a = allocated(bm, toks(0, 50))
    bm.commit(a, 40)  # blocks 0, 1 full and computed
    assert a.num_hashed_blocks == 2
    probe = allocated(bm, toks(0, 50))
    assert probe.num_cached_tokens == 32
    bm.commit(a, 50)  # block 2 now full too (48 <= 50)
    assert a.num_hashed_blocks == 3
    assert allocated(bm, toks(0, 50)).num_cached_tokens == 48


def test_a_live_shared_prefix_needs_no_free_blocks():
    bm = BlockManager(4, 16)
    allocated(bm, toks(0, 48), commit=True)  # 3 blocks held, 1 free
    b = FakeSeq(toks(0, 48) + toks(300, 10))  # 4 blocks, 3 of them a live hit
    assert bm.blocks_for(b.num_tokens) > bm.free
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 48 and bm.free == 0


def test_free_cached_hits_are_not_counted_twice():
    bm = BlockManager(4, 16)
    a = allocated(bm, toks(0, 48), commit=True)
    bm.deallocate(a)  # 4 free, 3 of them cached
    fits = FakeSeq(toks(0, 48) + toks(300, 16))  # 3 hits + 1 fresh
    assert bm.can_allocate(fits)
    too_big = FakeSeq(toks(0, 48) + toks(300, 17))  # 3 hits + 2 fresh, only 1 left beside the hits
    assert not bm.can_allocate(too_big)
    with pytest.raises(MemoryError):
        bm.allocate(too_big)
    bm.allocate(fits)
    assert fits.num_cached_tokens == 48 and bm.free == 0


# -- hits: whole granules, never the last token, chained ---------------------------------------


def test_prefix_hits_come_in_whole_granules():
    bm = BlockManager(32, 16, cache_granularity=32)
    allocated(bm, toks(0, 96), commit=True)
    # 3 blocks match, 2 used
    assert allocated(bm, toks(0, 48) + toks(900, 20)).num_cached_tokens == 32
    # 1 block: less than a granule
    assert allocated(bm, toks(0, 16) + toks(900, 40)).num_cached_tokens == 0
    assert allocated(bm, toks(0, 80) + toks(900, 5)).num_cached_tokens == 64


def test_prefix_hits_never_cover_the_last_token():
    bm = BlockManager(32, 16, cache_granularity=32)
    allocated(bm, toks(0, 96), commit=True)
    # identical 64: the last granule is recomputed
    assert allocated(bm, toks(0, 64)).num_cached_tokens == 32
    assert allocated(bm, toks(0, 65)).num_cached_tokens == 64
    assert allocated(bm, toks(0, 96)).num_cached_tokens == 64
    fine = BlockManager(8, 16)
    allocated(fine, toks(0, 32), commit=True)
    assert allocated(fine, toks(0, 32)).num_cached_tokens == 16
    assert allocated(fine, toks(0, 33)).num_cached_tokens == 32
    assert allocated(fine, toks(0, 1)).num_cached_tokens == 0


def test_same_block_content_after_a_different_prefix_is_not_a_hit():
    bm = BlockManager(16, 16)
    x, y, z = toks(0, 16), toks(16, 16), toks(40, 16)
    first = allocated(bm, x + y + [1], commit=True)
    other = allocated(bm, z + y + [1])  # block 1 has the same tokens, block 0 does not
    assert other.num_cached_tokens == 0
    assert not set(other.block_table) & set(first.block_table)
    assert allocated(bm, x + z + [1]).num_cached_tokens == 16  # only the first block matches
    assert allocated(bm, x + y + [2]).num_cached_tokens == 32


def test_identical_content_computed_twice_is_registered_once():
    bm = BlockManager(16, 16)
    a = allocated(bm, toks(0, 33))
    b = allocated(bm, toks(0, 33))  # before a committed: no hit
    bm.commit(a, 33)
    bm.commit(b, 33)
    assert len(bm.hash_to_block) == 2
    assert set(bm.hash_to_block.values()) == set(a.block_table[:2])
    c = allocated(bm, toks(0, 33))
    assert c.block_table[:2] == a.block_table[:2]


# -- LRU eviction ------------------------------------------------------------------------------


def test_freed_cached_blocks_are_reused_least_recently_freed_first():
    bm = BlockManager(4, 16)
    seqs = {name: allocated(bm, toks(100 * i, 16), commit=True) for i, name in enumerate("abcd")}
    block = {name: seq.block_table[0] for name, seq in seqs.items()}
    for name in "bdac":
        bm.deallocate(seqs[name])
    assert (bm.free, bm.cached) == (4, 4)
    fresh = [allocated(bm, toks(1000 + 100 * i, 16)).block_table[0] for i in range(3)]
    assert fresh == [block["b"], block["d"], block["a"]]
    assert bm.cached == 1


def test_an_evicted_hash_is_forgotten():
    bm = BlockManager(4, 16)
    a, b, c, d = (allocated(bm, toks(100 * i, 16), commit=True) for i in range(4))
    a_block = a.block_table[0]
    bm.deallocate(a)
    bm.deallocate(b)
    assert allocated(bm, toks(500, 16)).block_table == [a_block]  # a's, freed first, is evicted
    bm.deallocate(c)
    probe = allocated(bm, toks(0, 16) + [7])
    assert probe.num_cached_tokens == 0 and a_block not in probe.block_table


def test_a_hit_survives_eviction_of_older_blocks():
    bm = BlockManager(3, 16)
    a, b, c = (allocated(bm, toks(100 * i, 16), commit=True) for i in range(3))
    b_block = b.block_table[0]
    bm.deallocate(a)
    bm.deallocate(b)
    allocated(bm, toks(500, 16))  # evicts a's block, b's stays cached
    bm.deallocate(c)
    again = allocated(bm, toks(100, 16) + [7])
    assert again.num_cached_tokens == 16 and again.block_table[0] == b_block
    assert bm.free == 0


def test_a_sequence_frees_its_tail_first_so_its_prefix_is_evicted_last():
    bm = BlockManager(4, 16)
    a = allocated(bm, toks(0, 48), commit=True)
    dummy = allocated(bm, toks(900, 16))
    table = list(a.block_table)
    bm.deallocate(a)
    assert allocated(bm, toks(500, 16)).block_table == [table[2]]
    bm.deallocate(dummy)
    assert allocated(bm, toks(0, 32) + [7]).num_cached_tokens == 32


# -- growing -----------------------------------------------------------------------------------


def test_can_append_and_may_append_across_a_block_boundary():
    bm = BlockManager(2, 16)
    seq = allocated(bm, toks(0, 16))
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 1  # still fits its block
    seq.token_ids.append(1)  # token 17 crosses into block 2
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2 and bm.free == 0
    seq.token_ids += [1] * 15  # 32: still inside block 2
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    seq.token_ids.append(1)  # 33: a third block, none left
    assert not bm.can_append(seq)
    with pytest.raises(MemoryError):
        bm.may_append(seq)


def test_fresh_sequences_get_consecutive_blocks_and_grow_in_place():
    blocks = BlockManager(num_blocks=16, block_size=4)
    a, b = FakeSeq(list(range(10))), FakeSeq(list(range(100, 107)))
    blocks.allocate(a)
    blocks.allocate(b)
    for seq in (a, b):
        assert seq.block_table == list(
            range(seq.block_table[0], seq.block_table[0] + len(seq.block_table))
        )
    a.token_ids.extend([1, 2, 3])  # 13 tokens: a fourth block, right after its third if free
    blocks.may_append(a)
    assert len(a.block_table) == 4 and len(set(a.block_table)) == 4


# -- the prefix-cache summary (what the scheduler routes on) ------------------------------------


def test_summary_predicts_the_hit_the_cache_gives():
    from shared.values.prefix_hash import granule_keys

    bm = BlockManager(64, 16, cache_granularity=32)
    first = toks(1, 100)  # 3 whole granules of 32 (the 4th is partial)
    done = allocated(bm, first, commit=True)
    bm.deallocate(done)
    summary = set(bm.prefix_summary(100))
    prompt = first[:70] + toks(500, 60)  # shares 2 granules (64 tokens) with `first`
    keys = granule_keys(prompt, 16, 32)
    predicted = 0
    for key in keys:
        if key not in summary:
            break
        predicted += 32
    assert len(summary) == 3 and predicted == 64
    assert allocated(bm, prompt).num_cached_tokens == predicted


def test_summary_forgets_evicted_granules_and_keeps_the_newest():
    bm = BlockManager(8, 16, cache_granularity=32)  # room for 2 sequences of 64 tokens
    old = allocated(bm, toks(1, 64), commit=True)
    bm.deallocate(old)
    assert len(bm.prefix_summary(10)) == 2
    # takes every block: the old prefix is evicted
    newer = allocated(bm, toks(1000, 128), commit=True)
    assert len(bm.prefix_summary(10)) == 4 and len(bm.prefix_summary(1)) == 1
    assert bm.prefix_summary(1) == bm.prefix_summary(10)[-1:]
    bm.deallocate(newer)
    assert bm.prefix_summary(0) == []


def test_a_cache_hit_keeps_its_granule_among_the_newest():
    from shared.values.prefix_hash import granule_keys

    bm = BlockManager(64, 16, cache_granularity=32)
    hot, cold = toks(1, 64), toks(500, 64)
    for tokens in (hot, cold):
        bm.deallocate(allocated(bm, tokens, commit=True))
    again = allocated(bm, hot)  # a hit on hot's first granule
    assert again.num_cached_tokens == 32
    assert bm.prefix_summary(1) == granule_keys(hot, 16, 32)[:1]


def test_no_prefix_cache_past_cacheable_tokens():
    """A rope whose frequencies depend on the sequence's length (dynamic NTK, longrope) computes
    a longer sequence's keys differently: past `cacheable_tokens` nothing is looked up or kept."""
    bm = BlockManager(num_blocks=32, block_size=4, cacheable_tokens=16)
    short, long = FakeSeq(list(range(13))), FakeSeq(list(range(24)))
    for seq in (short, long):
        bm.allocate(seq)
        bm.commit(seq, seq.num_tokens)
    assert bm.cached == 0 and len(bm.hash_to_block) == 3  # the short one's 3 full blocks only
    again = FakeSeq(list(range(13)))
    bm.allocate(again)
    assert again.num_cached_tokens == 12
    longer = FakeSeq(list(range(30)))
    bm.allocate(longer)
    assert longer.num_cached_tokens == 0


def _first_fit(bm: BlockManager, count: int) -> int | None:
    """The lowest run of `count` free blocks caching no prefix, by a plain scan (the reference)."""
    run = 0
    for block in range(bm.num_blocks):
        free = block in bm.free_blocks and bm.block_hash[block] is None
        run = run + 1 if free else 0
        if run == count:
            return block - count + 1
    return None


def test_runs_are_found_where_a_plain_scan_finds_them_through_random_traffic():
    """Allocations, growth, commits (cached blocks), frees and evictions in random order: the
    usable map always says which blocks are free and cache nothing, and a run is found at the
    lowest place a scan of the pool finds one."""
    import random

    rng = random.Random(7)
    bm = BlockManager(num_blocks=64, block_size=4)
    live: list[FakeSeq] = []
    for step in range(3000):
        roll = rng.random()
        if roll < 0.45:
            tokens = toks(rng.choice([0, 100, 200, 300 + step]), rng.randint(1, 24))
            seq = FakeSeq(tokens)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                if rng.random() < 0.5:
                    bm.commit(seq, seq.num_tokens)
                live.append(seq)
        elif roll < 0.65 and live:
            seq = rng.choice(live)
            seq.token_ids.append(7)
            if bm.can_append(seq):
                bm.may_append(seq)
            else:
                seq.token_ids.pop()
        elif live:
            bm.deallocate(live.pop(rng.randrange(len(live))))
        for block in range(bm.num_blocks):
            free = block in bm.free_blocks and bm.block_hash[block] is None
            assert bm.usable[block] == free, (step, block)
        for count in (1, 2, 3, 5):
            assert bm._find_run(count, None) == _first_fit(bm, count), (step, count)
    assert bm.leaked([s.block_table for s in live]) == 0
