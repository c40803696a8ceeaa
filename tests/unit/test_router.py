"""Routing policy over fake worker states: load, prefix credit, topology, capacity, mode switching."""

import pytest

from services.scheduler import cost
from services.scheduler.registry import WorkerRegistry
from services.scheduler.router import NoRoom, NoWorker, Policy, Router, TooLarge
from shared.control.failure import Code
from shared.control.messages import GenerateTask, KVLayout, SamplingParams, WorkerHeartbeat
from shared.control.wire import decode, encode
from shared.control.worker_roles import Mode, Role
from shared.values.prefix_hash import granule_keys

LAYOUT = KVLayout(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
G = 32  # prefix granularity of the fake workers (2 blocks of 16)


def beat(worker_id: str, role: str = "decode", host: str = "h", **kw) -> WorkerHeartbeat:
    values = dict(
        kv_blocks_total=1000,
        block_size=16,
        max_model_len=8192,
        max_num_seqs=8,
        prefill_tokens_per_s=1000.0,
        prefix_granularity=G,
        layout=LAYOUT,
    )
    values.update(kw)
    return WorkerHeartbeat(
        worker_id=worker_id, role=role, host=host, pid=1, ucx_address=worker_id.encode(), **values
    )


def task(
    prompt_len: int = 10, max_tokens: int = 6, prompt: list[int] | None = None, priority: int = 0
) -> GenerateTask:
    ids = prompt if prompt is not None else list(range(1, prompt_len + 1))
    return GenerateTask(
        attempt_id="r",
        prompt_token_ids=ids,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_subject="g",
        arrival_time=0.0,
        priority=priority,
    )


def router(*beats: WorkerHeartbeat, **policy) -> Router:
    now = [0.0]
    registry = WorkerRegistry(timeout_s=3.0, clock=lambda: now[0])
    now[0] = 10.0  # past its start's settling time: no heartbeat is still on its way
    for b in beats:
        registry.update(b)
    return Router(registry, Policy(**{"mode": "disaggregated", **policy}))


def cached(prompt: list[int], granules: int) -> list[int]:
    return granule_keys(prompt, 16, G)[:granules]


# --- decode: fill evenly, never a worker that cannot hold the sequence ------------------------


def test_decode_goes_to_the_emptiest_worker():
    r = router(
        beat("d1", running=6),
        beat("d2", running=1, queued=1),
        beat("d3", kv_blocks_used=800),
        beat("p", role="prefill"),
    )
    assert r.route(task()).decode.worker_id == "d2"


def test_decode_never_goes_where_the_sequence_does_not_fit():
    # prompt 100 + 60 new = 160 tokens = 10 blocks of 16
    r = router(
        beat("d1", kv_blocks_used=991),
        beat("d2", running=5, kv_blocks_used=990),
        beat("p", role="prefill"),
    )
    assert r.route(task(100, 60)).decode.worker_id == "d2"
    with pytest.raises(NoRoom):
        r.route(task(100, 61))


def test_full_batch_is_no_room_and_an_oversized_request_is_too_large():
    r = router(beat("d1", running=8), beat("p", role="prefill"))
    with pytest.raises(NoRoom):
        r.route(task())
    with pytest.raises(TooLarge):
        router(beat("d1", max_model_len=100), beat("p", role="prefill")).route(task(90, 20))


def test_itl_target_keeps_sequences_off_a_worker_whose_tokens_are_already_slow():
    slow, fast = (
        beat("d1", running=2, decode_step_ms=300.0),
        beat("d2", running=5, decode_step_ms=120.0),
    )
    assert router(slow, fast, beat("p", role="prefill")).route(task()).decode.worker_id == "d1"
    assert (
        router(slow, fast, beat("p", role="prefill"), max_itl_ms=200).route(task()).decode.worker_id
        == "d2"
    )
    with pytest.raises(NoRoom, match="slower than 200 ms"):
        router(slow, beat("p", role="prefill"), max_itl_ms=200).route(task())
    # its last batch has gone: the figure is stale
    idle = beat("d1", running=0, decode_step_ms=300.0)
    assert (
        router(idle, beat("p", role="prefill"), max_itl_ms=200).route(task()).decode.worker_id
        == "d1"
    )
    # 4 decoding at 150 ms, 2 more about to join: about 225 ms once they do
    joining = beat("d1", running=4, queued=2, decode_step_ms=150.0)
    with pytest.raises(NoRoom):
        router(joining, beat("p", role="prefill"), max_itl_ms=200).route(task())
    one_joining = beat("d1", running=4, queued=1, decode_step_ms=150.0)  # about 188 ms
    assert (
        router(one_joining, beat("p", role="prefill"), max_itl_ms=200)
        .route(task())
        .decode.worker_id
        == "d1"
    )


def test_no_decode_worker_is_unavailable_and_exclude_is_honoured():
    r = router(beat("d1"), beat("d2", running=4), beat("p", role="prefill"))
    assert r.route(task(), exclude={"d1"}).decode.worker_id == "d2"
    with pytest.raises(NoWorker) as err:
        r.route(task(), exclude={"d1", "d2"})
    assert err.value.code is Code.UNAVAILABLE


# --- prefill: least expected wait, with a credit for the prefix cache ---------------------------


def test_prefill_goes_to_the_least_expected_wait_in_tokens_not_requests():
    # p1 has one request queued but it is short; p2 has none queued but is slower.
    r = router(
        beat("d"),
        beat("p1", role="prefill", queued=1, prefill_tokens_queued=100),
        beat("p2", role="prefill", prefill_tokens_per_s=200.0),
    )
    assert r.route(task(400)).prefill.worker_id == "p1"  # (100+400)/1000 < 400/200


def test_prefix_cache_overlap_earns_a_credit():
    prompt = list(range(1, 1001))
    warm = cached(prompt, granules=30)  # 960 of 1000 tokens cached on p2
    r = router(
        beat("d"),
        beat("p1", role="prefill"),
        beat("p2", role="prefill", prefill_tokens_queued=500, prefix_summary=warm),
    )
    chosen = r.route(task(prompt=prompt))
    assert chosen.prefill.worker_id == "p2" and chosen.compute_tokens == 40
    # The credit counts leading granules only: a summary without the first granule is worth nothing.
    r = router(
        beat("d"),
        beat("p1", role="prefill"),
        beat("p2", role="prefill", prefill_tokens_queued=500, prefix_summary=warm[1:]),
    )
    assert r.route(task(prompt=prompt)).prefill.worker_id == "p1"


def test_prefill_with_another_layout_is_excluded():
    other = KVLayout(model="other", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
    r = router(
        beat("d1"), beat("p1", role="prefill", layout=other), beat("p2", role="prefill", queued=5)
    )
    assert r.route(task()).prefill.worker_id == "p2"
    r.registry.drop("p2")
    with pytest.raises(NoWorker, match="layout"):
        r.route(task())


# --- topology -----------------------------------------------------------------------------------


def test_same_host_pair_wins_among_near_equal_choices():
    r = router(
        beat("d1", host="a"),
        beat("d2", host="b", running=0),
        beat("p1", role="prefill", host="b", prefill_tokens_queued=5),
    )
    chosen = r.route(task(2000, 6))
    assert (chosen.prefill.worker_id, chosen.decode.worker_id) == ("p1", "d2")


def test_same_zone_beats_cross_zone_and_a_much_shorter_queue_beats_both():
    r = router(
        beat("d", host="a", zone="z1"),
        beat("p1", role="prefill", host="b", zone="z1"),
        beat("p2", role="prefill", host="c", zone="z2"),
    )
    assert r.route(task(2000)).prefill.worker_id == "p1"
    r = router(
        beat("d", host="a", zone="z1"),
        beat("p1", role="prefill", host="a", prefill_tokens_queued=20000),
        beat("p2", role="prefill", host="c", zone="z2"),
    )
    assert r.route(task(2000)).prefill.worker_id == "p2"


def test_cost_model_orders_bandwidths():
    a, b = beat("a", host="x", zone="z"), beat("b", host="y", zone="z")
    c = beat("c", host="w", zone="q")
    assert cost.bandwidth(a, a) > cost.bandwidth(a, b) > cost.bandwidth(a, c)
    assert cost.kv_bytes_per_token(LAYOUT) == 2 * 2 * 2 * 16 * 4


def test_a_busier_decode_worker_is_not_chosen_for_topology():
    # d1 is next to the prefill worker but far fuller: evenness first, topology among equals.
    r = router(
        beat("d1", host="b", running=6), beat("d2", host="a"), beat("p1", role="prefill", host="b")
    )
    assert r.route(task(2000)).decode.worker_id == "d2"


# --- modes --------------------------------------------------------------------------------------


def test_auto_prefills_short_prompts_on_the_decode_worker():
    r = router(beat("d"), beat("p", role="prefill"), mode="auto", local_prefill_tokens=256)
    assert r.route(task(200)).prefill is None
    assert r.route(task(300)).prefill.worker_id == "p"


def test_auto_threshold_counts_tokens_after_the_decode_workers_prefix_cache():
    prompt = list(range(1, 1001))
    r = router(
        beat("d", prefix_summary=cached(prompt, 30)),
        beat("p", role="prefill"),
        mode="auto",
        local_prefill_tokens=256,
    )
    chosen = r.route(task(prompt=prompt))
    assert chosen.prefill is None and chosen.decode_cached == 960


def test_auto_goes_local_when_the_prefill_pool_is_busy_and_local_is_sooner():
    busy = beat("p", role="prefill", prefill_tokens_queued=20000)  # 20 s of work queued
    assert (
        router(beat("d"), busy, mode="auto", prefill_busy_s=5.0).route(task(1000)).prefill is None
    )
    # Busy, but the decode worker is busier still: stay disaggregated.
    r = router(beat("d", prefill_tokens_queued=50000), busy, mode="auto", prefill_busy_s=5.0)
    assert r.route(task(1000)).prefill.worker_id == "p"
    # Busy, and the local prefill alone is sooner, but 30 streams decoding there would each stall
    # for it (1 s x 31 > 21 s): the prefill tax is counted, so it stays disaggregated.
    r = router(beat("d", running=30, max_num_seqs=64), busy, mode="auto", prefill_busy_s=5.0)
    assert r.route(task(1000)).prefill.worker_id == "p"


def test_auto_without_prefill_workers_prefills_locally_and_uses_colocated_workers():
    assert router(beat("d"), mode="auto").route(task(1000)).prefill is None
    assert (
        router(beat("c", role="colocated"), mode="auto").route(task(1000)).decode.worker_id == "c"
    )


def test_disaggregated_always_uses_a_prefill_worker_and_colocated_never():
    r = router(beat("d"), beat("c", role="colocated", running=1), beat("p", role="prefill"))
    assert r.route(task(1)).prefill.worker_id == "p" and r.route(task(1)).decode.worker_id == "d"
    r = router(
        beat("d"),
        beat("p", role="prefill"),
        beat("c", role="colocated", running=1),
        mode="colocated",
    )
    chosen = r.route(task(5000, 6))
    assert chosen.decode.worker_id == "c" and chosen.prefill is None


@pytest.mark.parametrize("over_the_wire", [False, True], ids=["in-process", "decoded"])
def test_roles_and_modes_route_the_same_as_members_or_as_plain_strings(over_the_wire):
    """Heartbeats from the wire carry Role members, tests and older code plain strings; a
    Mode member and its string choose the same path."""

    def worker(worker_id: str, role: Role, **kw) -> WorkerHeartbeat:
        b = beat(worker_id, role=role if over_the_wire else role.value, **kw)
        return decode(encode(b), WorkerHeartbeat) if over_the_wire else b

    beats = (
        worker("d", Role.DECODE),
        worker("c", Role.COLOCATED, running=1),
        worker("p", Role.PREFILL),
    )
    if over_the_wire:
        assert [type(b.role) for b in beats] == [Role] * 3
    for mode in (Mode.DISAGGREGATED, "disaggregated"):
        chosen = router(*beats, mode=mode).route(task(1))
        assert (chosen.decode.worker_id, chosen.prefill.worker_id) == ("d", "p")
    for mode in (Mode.COLOCATED, "colocated"):
        chosen = router(*beats, mode=mode).route(task(5000, 6))
        assert chosen.decode.worker_id == "c" and chosen.prefill is None
    for mode in (Mode.AUTO, "auto"):
        assert router(*beats, mode=mode).route(task(1)).prefill is None  # short: locally
        assert router(*beats, mode=mode).registry.live(Role.PREFILL) == [beats[2]]


# --- disaggregated with no live prefill worker: prefill_fallback --------------------------------


def test_with_its_last_prefill_worker_lost_a_prompt_is_prefilled_on_its_decode_worker():
    r = router(beat("d1"), beat("d2", running=3), beat("p", role="prefill"))
    assert r.route(task(1000)).prefill.worker_id == "p" and not r.route(task(1000)).fallback
    chosen = r.route(task(1000), exclude={"p"})  # p failed it mid-prompt
    assert (chosen.decode.worker_id, chosen.prefill, chosen.fallback) == ("d1", None, True)
    assert chosen.compute_tokens == 1000 and chosen.blocks > 0
    assert router(beat("d")).route(task()).fallback  # none ever came: the default serves too
    # still subject to the limit on prompt work queued ahead, there on the decode worker
    busy = router(beat("d", prefill_tokens_queued=100_000), max_prefill_wait_s=60)
    with pytest.raises(NoRoom, match="queued ahead"):
        busy.route(task(1000))


def test_the_local_fallback_is_only_for_a_pool_with_no_live_prefill_worker():
    full = router(beat("d"), beat("p", role="prefill", queued=4, max_queue=4))
    with pytest.raises(NoRoom, match="queue is full"):
        full.route(task(100))
    other = KVLayout(model="other", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(NoWorker, match="layout"):
        router(beat("d"), beat("p", role="prefill", layout=other)).route(task())
    with pytest.raises(TooLarge, match="prefill worker's KV cache"):
        router(beat("d"), beat("p", role="prefill", kv_blocks_total=10)).route(task(500))


def test_just_after_a_start_or_an_outage_the_local_fallback_waits_for_heartbeats():
    r = router(beat("d"))
    r.registry.excuse()  # it hears again: the prefill workers' heartbeats may be on their way
    with pytest.raises(NoRoom, match="no live prefill worker"):
        r.route(task())


def test_prefill_fallback_wait_keeps_the_request_waiting_for_a_prefill_worker():
    r = router(beat("d"), beat("p", role="prefill"), prefill_fallback="wait")
    with pytest.raises(NoRoom, match="no live prefill worker") as err:
        r.route(task(1000), exclude={"p"})
    assert type(err.value) is NoRoom and err.value.code is Code.RESOURCE_EXHAUSTED
    r.registry.update(beat("p2", role="prefill"))  # the replacement came
    assert r.route(task(1000), exclude={"p"}).prefill.worker_id == "p2"


def test_prefill_fallback_fail_is_unavailable():
    r = router(beat("d"), beat("p", role="prefill"), prefill_fallback="fail")
    with pytest.raises(NoWorker, match="no live prefill worker") as err:
        r.route(task(1000), exclude={"p"})
    assert type(err.value) is NoWorker and err.value.code is Code.UNAVAILABLE


def test_a_prefill_wait_over_the_limit_is_no_room():
    r = router(
        beat("d"), beat("p", role="prefill", prefill_tokens_queued=100_000), max_prefill_wait_s=60
    )
    with pytest.raises(NoRoom, match="queued ahead"):
        r.route(task(1000))
    # Its own compute does not count: an idle worker takes a prompt however long it takes.
    slow = router(
        beat("d"), beat("p", role="prefill", prefill_tokens_per_s=10.0), max_prefill_wait_s=60
    )
    assert slow.route(task(7000)).prefill.worker_id == "p"


def test_a_prefill_worker_that_would_refuse_the_prompt_is_not_a_candidate():
    # p1 is cheaper, but its queue is full: the prompt goes to p2; with p2 full too, no room.
    r = router(
        beat("d", kv_blocks_total=10_000),
        beat("p1", role="prefill", running=1, queued=3, max_queue=4),
        beat("p2", role="prefill", prefill_tokens_queued=900, max_queue=4),
    )
    assert r.route(task(100)).prefill.worker_id == "p2"
    r.registry.update(beat("p2", role="prefill", queued=4, max_queue=4))
    with pytest.raises(NoRoom, match="prefill worker's queue is full"):
        r.route(task(100))
    # A prompt larger than p1's KV budget goes to p2, whose budget holds it; larger than both: too large.
    r = router(
        beat("d", kv_blocks_total=10_000),
        beat("p1", role="prefill", kv_blocks_total=10),
        beat("p2", role="prefill", kv_blocks_total=100, prefill_tokens_queued=900),
    )
    assert r.route(task(500)).prefill.worker_id == "p2"
    with pytest.raises(TooLarge, match="prefill worker's KV cache"):
        r.route(task(1700))
    # Under auto, a full prefill pool leaves the local path.
    r = router(beat("d"), beat("p", role="prefill", queued=4, max_queue=4), mode="auto")
    assert r.route(task(1000)).prefill is None


def test_a_decode_worker_whose_queue_is_full_is_not_a_candidate():
    r = router(
        beat("d1", queued=2, max_queue=2, max_num_seqs=8),
        beat("d2", running=3),
        beat("p", role="prefill"),
    )
    assert r.route(task()).decode.worker_id == "d2"


def test_equal_cost_pairs_go_to_the_emptier_decode_worker():
    r = router(beat("d1", running=2), beat("d2", running=1), beat("p", role="prefill"))
    assert r.route(task(500)).decode.worker_id == "d2"
    r = router(beat("d1", running=2), beat("d2", running=1), mode="colocated")
    r.registry.update(beat("c1", role="colocated", running=2))
    r.registry.update(beat("c2", role="colocated", running=1))
    assert r.route(task(500)).decode.worker_id == "c2"
