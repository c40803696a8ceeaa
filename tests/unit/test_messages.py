"""The wire format: every message survives a round trip; anything malformed is a MessageError."""

import dataclasses

import msgpack
import msgspec
import pytest

from shared.control import rules
from shared.control.failure import Code, Retry, failed, worker_failed, worker_full
from shared.control.finish import FinishReason
from shared.control.holdings import ClientHolding, GatewayHoldings
from shared.control.messages import (
    MESSAGE_TYPES,
    CancelRequest,
    DecodeAssignment,
    Discover,
    GenerateTask,
    KVDestination,
    KVLayout,
    Ping,
    PrefillResult,
    PrefillTask,
    Room,
    SamplingParams,
    SchedulerHeartbeat,
    StatusReply,
    StatusRequest,
    StreamReplay,
    SubmitReply,
    TaskAck,
    Timing,
    TokenBatch,
    TokenChunk,
    TransferAbort,
    WorkerHeartbeat,
    WorkerStatus,
)
from shared.control.wire import MAX_MESSAGE_BYTES, MessageError, decode, encode

SAMPLING = SamplingParams(
    max_tokens=7,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=2**63 - 1,
    stop=["\n\n", "日本"],
    ignore_eos=True,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    bias_token_ids=[5, 49151],
    bias_values=[-100.0, 2.5],
    min_tokens=3,
)
LAYOUT = KVLayout(model="m", dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64)
TASK = GenerateTask(
    attempt_id="r1",
    prompt_token_ids=[1, 2, 49151],
    sampling=SAMPLING,
    reply_subject="tandem.c.gateway.g.tokens",
    arrival_time=1.5,
    deadline=9.25,
)


def beat(worker_id: str, **kw) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        role="decode",
        host="h",
        pid=7,
        ucx_address=b"\x00\xffaddr",
        layout=LAYOUT,
        max_model_len=8192,
        **kw,
    )


SAMPLES = [
    TASK,
    SubmitReply(worker_failed("d", "m"), prefill_worker="p", decode_worker="d"),
    DecodeAssignment(task=TASK, prefill_worker="prefill-1"),
    TaskAck(),
    PrefillTask(
        task=TASK,
        layout=LAYOUT,
        destination=KVDestination(
            ucx_address=bytes(range(256)),
            base_tag=2**64 - 2**24,
            block_ids=[7, 3],
            skip_tokens=16,
            segment_tokens=64,
            lease_s=5.0,
        ),
        decode_worker="d",
    ),
    PrefillResult(attempt_id="r1", base_tag=3, first_tokens=[42], kv_bytes=1024, queue_ms=0.5),
    PrefillResult(
        attempt_id="r1", base_tag=3, failure=failed(Code.CANCELLED, "gone"), pieces_sent=120
    ),
    TransferAbort(attempt_id="r1", base_tag=2**40, reason="lease expired"),
    TokenChunk(
        attempt_id="r1",
        index=3,
        token_ids=[9],
        text="é🙂",
        finish_reason="stop",
        timing=Timing(
            queue_ms=1.0, prefill_ms=2.0, kv_transfer_ms=3.0, prefill_worker="p", decode_worker="d"
        ),
    ),
    CancelRequest(attempt_id="r1"),
    beat(
        "w1",
        running=2,
        kv_blocks_used=3,
        kv_blocks_total=10,
        stopping=True,
        kernels="avx2 · bfloat16 emulated · matmul torch · attention paged-c++ · invariant rows 1-16",
    ),
    Discover(scheduler_id="s"),
    StatusRequest(),
    Ping(),
    SubmitReply(prefill_worker="p", decode_worker="d"),  # placed: no failure
    TaskAck(worker_full("d", "full")),
    TokenChunk(attempt_id="r1", index=4, failure=worker_failed("d", "shut down")),
    TokenBatch([TokenChunk("r1", 5, [7, 8], "ab"), TokenChunk("r2", 0, finish_reason="stop")]),
    StreamReplay(attempt_id="r1", from_index=3),
    SchedulerHeartbeat(scheduler_id="s1", queued=2),
    GatewayHoldings("gw-1", 512, [ClientHolding("key:a", streams=3, queued=1, kv_tokens=900)]),
    StatusReply(
        mode="disaggregated",
        ready=True,
        workers=[
            WorkerStatus(worker_id="w1", role="decode", host="h", pid=7),
            WorkerStatus(
                worker_id="w2", role="decode", host="h", pid=7, queued=4, kernels="avx512 · f32"
            ),
        ],
        more=True,
    ),
]


def test_samples_cover_every_message_type():
    assert {type(m).__name__ for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    back = decode(encode(message), type(message))
    assert same(back, message)
    assert type(back) is type(message)


def same(a, b) -> bool:
    """Equal, but for deadlines: they travel as time left, and come back within a moment."""
    if not dataclasses.is_dataclass(a):
        return a == b
    return type(a) is type(b) and all(
        abs(getattr(a, f.name) - getattr(b, f.name)) < 0.5
        if f.name == "deadline"
        else same(getattr(a, f.name), getattr(b, f.name))
        for f in dataclasses.fields(a)
    )


def test_round_trip_keeps_nested_types():
    chunk = decode(encode(TokenChunk(attempt_id="r", index=0)), TokenChunk)
    assert chunk.timing is None
    reply = decode(encode(SAMPLES[-1]), StatusReply)
    assert isinstance(reply.workers[0], WorkerStatus) and reply.more
    beat_back = decode(encode(SAMPLES[10]), WorkerHeartbeat)
    assert isinstance(beat_back.layout, KVLayout) and isinstance(beat_back.ucx_address, bytes)
    task = decode(encode(TASK), GenerateTask)
    assert isinstance(task.sampling, SamplingParams)


def raw(**body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never-used msgpack byte
        b"",
        raw(type="NoSuchMessage"),
        msgpack.packb([1, 2, 3]),  # not a map
        raw(ok=True),  # no type
        raw(type="PrefillResult", attempt_id="r"),  # missing required field
        raw(type="StatusReply", mode="m", ready="yes"),  # str for bool
        raw(type="TokenChunk", attempt_id="r", index="1"),  # str for int
        raw(type="TokenChunk", attempt_id="r", index=True),  # bool for int
        raw(type="TokenChunk", attempt_id="r", index=1.0),  # float for int
        raw(type="TokenChunk", attempt_id="r", index=0, token_ids=[1, True]),
        raw(type="TokenChunk", attempt_id="r", index=0, token_ids=5),
        raw(type="TokenChunk", attempt_id="r", index=0, timing=5),
        raw(type="TokenChunk", attempt_id="r", index=0, timing={"queue_ms": "x"}),
        raw(type="CancelRequest", attempt_id=None),
        raw(type="StatusReply", mode="m", ready=True, workers=[{"worker_id": "w"}]),
        raw(type="DecodeAssignment", task={"attempt_id": "r"}),
    ],
)
def test_rejects_malformed(data):
    with pytest.raises(MessageError):
        decode(data)


def test_rejects_str_for_bytes():
    body = msgpack.unpackb(encode(SAMPLES[4]), raw=False)
    body["destination"]["ucx_address"] = "text"
    with pytest.raises(MessageError):
        decode(msgpack.packb(body, use_bin_type=True))


def test_float_field_accepts_int():
    chunk = decode(
        raw(type="PrefillResult", attempt_id="r", base_tag=1, queue_ms=3, first_tokens=[1]),
        PrefillResult,
    )
    assert chunk.queue_ms == 3.0 and isinstance(chunk.queue_ms, float)


def test_expected_type_mismatch():
    with pytest.raises(MessageError, match="expected TaskAck"):
        decode(encode(SubmitReply()), TaskAck)


def test_encode_rejects_non_messages():
    with pytest.raises(MessageError):
        encode(SamplingParams())
    with pytest.raises(MessageError):
        encode({"type": "TaskAck", "ok": True})


def test_oversized_payloads():
    big = TokenChunk(attempt_id="r", index=0, text="x" * MAX_MESSAGE_BYTES)
    with pytest.raises(MessageError, match="limit"):
        encode(big)
    with pytest.raises(MessageError):
        decode(raw(type="TokenChunk", attempt_id="r", index=0, text="x" * MAX_MESSAGE_BYTES))


def test_largest_generate_task_fits():
    sampling = SamplingParams(max_tokens=1, stop=["s" * 255 + str(i % 10) for i in range(16)])
    ids = [49151 - (i % 1000) for i in range(8192)]
    task = GenerateTask(
        attempt_id="r" * 128,
        prompt_token_ids=ids,
        sampling=sampling,
        reply_subject="tandem." + "c" * 64 + ".gateway.g.tokens",
        arrival_time=1.0,
    )
    data = encode(task)
    assert len(data) < MAX_MESSAGE_BYTES < 1024 * 1024
    assert len(data) < 64 * 1024  # ~3 bytes per id + stops: far from the limit
    assert decode(data, GenerateTask) == task


def _with(message, path: str, value) -> bytes:
    """`message` encoded, with the field at dotted `path` set to `value` (what a hostile peer sends)."""
    body = msgpack.unpackb(encode(message), raw=False)
    *parents, name = path.split(".")
    target = body
    for p in parents:
        target = target[p]
    target[name] = value
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "message, path, value",
    [
        (TASK, "sampling.max_tokens", 0),
        (TASK, "sampling.max_tokens", -5),
        (TASK, "sampling.temperature", float("nan")),
        (TASK, "sampling.temperature", -1.0),
        (TASK, "sampling.top_p", 0.0),
        (TASK, "sampling.top_p", 1.5),
        (TASK, "sampling.stop", ["x"] * 65),
        (TASK, "sampling.stop", ["x" * 70_000]),
        (TASK, "sampling.presence_penalty", 2.5),
        (TASK, "sampling.frequency_penalty", float("nan")),
        (TASK, "sampling.frequency_penalty", -2.01),
        (TASK, "sampling.repetition_penalty", 0.0),
        (TASK, "sampling.repetition_penalty", float("inf")),
        (TASK, "sampling.min_tokens", 8),  # above max_tokens
        (TASK, "sampling.bias_token_ids", [5]),  # fewer than its values
        (TASK, "sampling.bias_token_ids", [5, 5]),  # a token twice
        (TASK, "sampling.bias_token_ids", [5, 2**31]),
        (TASK, "sampling.bias_values", [-100.0, 100.5]),
        (TASK, "sampling.bias_values", [-100.0, float("nan")]),
        (TASK, "prompt_token_ids", []),
        (TASK, "prompt_token_ids", [1, -2]),
        (TASK, "prompt_token_ids", [1, 2**31]),
        (TASK, "resume_tokens", 3),  # the whole prompt: nothing left that is prompt
        (TASK, "resume_tokens", -1),
        (TASK, "priority", 2**31),
        (TASK, "deadline", float("inf")),
        (TASK, "arrival_time", float("nan")),
        (SAMPLES[4], "destination.lease_s", 1e9),
        (TASK, "attempt_id", ""),
        (TASK, "avoid_workers", ["w"] * 65),
        (SAMPLES[4], "destination.block_ids", [7, -1]),
        (SAMPLES[4], "destination.lease_s", 0.0),
        (SAMPLES[4], "destination.segment_tokens", 0),
        (SAMPLES[4], "layout.num_layers", 0),
        (SAMPLES[4], "layout.head_dim", 10**6),
        (SAMPLES[5], "first_tokens", [-2]),
        (SAMPLES[5], "first_tokens", [2**31]),
        (SAMPLES[5], "pieces_sent", -1),
        (SAMPLES[8], "index", -1),
        (SAMPLES[10], "kv_blocks_used", -3),
        (SAMPLES[10], "prefix_summary", [-1]),
        (SAMPLES[10], "kernels", "x" * 257),
    ],
)
def test_values_out_of_range_are_rejected_on_receipt(message, path, value):
    with pytest.raises(MessageError):
        decode(_with(message, path, value))


def test_acks_results_and_chunks_carry_a_typed_failure():
    gone = worker_failed("p1", "KV transfer failed")
    messages = [
        TaskAck(gone),
        PrefillResult(attempt_id="r", base_tag=1, failure=gone),
        TokenChunk(attempt_id="r", index=0, failure=gone),
    ]
    for message in messages:
        back = decode(encode(message), type(message))
        assert back.failure == gone and type(back.failure.retry) is Retry
    assert not TaskAck(gone).ok and TaskAck().ok
    assert not PrefillResult("r", 1, gone).ok and PrefillResult("r", 1).ok


def test_a_submit_reply_carries_a_typed_failure():
    for failure in (failed(Code.CANCELLED, "gone"), worker_failed("d1", "no answer")):
        reply = decode(encode(SubmitReply(failure, retry_after_ms=5)), SubmitReply)
        assert reply.failure == failure and not reply.ok
        assert type(reply.failure.code) is Code and type(reply.failure.retry) is Retry
    assert decode(encode(SubmitReply(decode_worker="d")), SubmitReply).ok


@pytest.mark.parametrize(
    "path, value",
    [
        ("failure.code", "NOT_A_CODE"),
        ("failure.code", "unavailable"),
        ("failure.retry", "sometimes"),
        ("failure.retry", 1),
        ("failure", "UNAVAILABLE"),
    ],
)
def test_a_failure_with_an_unknown_code_or_retry_is_refused(path, value):
    with pytest.raises(MessageError):
        decode(_with(SAMPLES[1], path, value))


def test_values_at_the_edges_are_accepted():
    edge = dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=100.0)
    bias = dict(bias_token_ids=list(range(1024)), bias_values=[100.0, -100.0] * 512)
    sampling = SamplingParams(max_tokens=7, min_tokens=7, **edge, **bias)
    task = GenerateTask("r", [1, 2], sampling, "reply", 1.0)
    assert decode(encode(task), GenerateTask) == task
    assert decode(_with(TASK, "priority", -(2**31))).priority == -(2**31)
    assert decode(_with(TASK, "resume_tokens", 2)).resume_tokens == 2
    assert decode(_with(SAMPLES[5], "first_tokens", [2**31 - 1])).first_tokens == [2**31 - 1]
    assert decode(_with(SAMPLES[10], "prefix_summary", [2**64 - 1])).prefix_summary == [2**64 - 1]
    assert decode(_with(SAMPLES[10], "kernels", "·" * 256)).kernels == "·" * 256
    # a difference of two hosts' clocks may be negative: a timing is finite, not necessarily >= 0
    assert decode(_with(SAMPLES[8], "timing.queue_ms", -3.5)).timing.queue_ms == -3.5


def test_a_layout_from_before_block_major_pools_never_equals_one_of_today():
    """A heartbeat from a worker that predates KVLayout.pool_order decodes with it empty: the
    router pairs no such worker with one whose pool is block-major (the KV would land scrambled)."""
    from dataclasses import replace

    from shared.engine.kv_cache import POOL_ORDER

    today = replace(SAMPLES[10], layout=replace(LAYOUT, pool_order=POOL_ORDER))
    body = msgpack.unpackb(encode(today), raw=False)
    del body["layout"]["pool_order"]
    before = decode(msgpack.packb(body, use_bin_type=True), WorkerHeartbeat)
    assert before.layout.pool_order == "" and before.layout != today.layout
    assert decode(encode(today), WorkerHeartbeat).layout == today.layout


@pytest.mark.parametrize("cls", MESSAGE_TYPES.values(), ids=lambda cls: cls.__name__)
def test_a_message_about_an_attempt_declares_it(cls):
    """The bus asks isinstance(message, AboutAnAttempt) for a handler's log lines: a message
    with an attempt id, or with the request itself, must say so."""
    from shared.control.attempts import AboutAnAttempt, AboutATask

    names = {f.name for f in dataclasses.fields(cls)}
    assert issubclass(cls, AboutAnAttempt) == bool(names & {"attempt_id", "task"})
    assert issubclass(cls, AboutATask) == ("task" in names)


def test_a_message_that_carries_the_request_is_about_its_attempt():
    task = GenerateTask("a.1", [1], SamplingParams(), "reply", 0.0)
    assert DecodeAssignment(task=task).attempt_id == "a.1"
    layout, destination = KVLayout("m", "float32", 1, 1, 4), KVDestination(b"u", 1, [0])
    assert PrefillTask(task, layout, destination, "d1").attempt_id == "a.1"


def test_fields_at_their_defaults_are_left_out_and_come_back():
    """A token's chunk carries its id, index, tokens and text, not the eight fields it leaves at
    their defaults (the receiver's dataclass gives them back); a field set to anything else,
    an empty string where the default is not, or 0 where it is 0.0, travels."""
    chunk = TokenChunk("r-1", 3, token_ids=[5], text=" a")
    body = msgpack.unpackb(encode(chunk), raw=False)
    assert set(body) == {"type", "attempt_id", "index", "token_ids", "text"}
    assert decode(encode(chunk), TokenChunk) == chunk
    assert set(msgpack.unpackb(encode(TokenChunk("r-1", 0)), raw=False)) == {
        "type",
        "attempt_id",
        "index",
    }
    ended = TokenChunk("r-1", 4, finish_reason=FinishReason.STOP, completion_tokens=9)
    body = msgpack.unpackb(encode(ended), raw=False)
    assert body["finish_reason"] == "stop" and body["completion_tokens"] == 9
    assert decode(encode(ended), TokenChunk) == ended


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_only_the_fields_a_payload_carries_are_range_checked_and_defaults_pass(message):
    """The range checks skip a field the payload left out: so every default must be in range."""
    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(message)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    at_defaults = dataclasses.replace(message, **defaults)
    every_field = msgspec.to_builtins(at_defaults, builtin_types=(bytes,))  # none left out
    # each field's own range (not the whole's rules, EXTRA: a default max_tokens may be below
    # a sample's min_tokens)
    msgspec.convert(every_field, rules.ranged(type(message)), strict=True, builtin_types=(bytes,))


def test_a_room_out_of_range_is_refused_in_any_list_of_a_beat():
    """A room's own rule (its tp, how many prefill workers it names) is checked in each of the
    heartbeat's lists of rooms, as the field ranges are."""
    room = Room("d1", 1, 16, prefill_workers=["p1"])
    beat = SchedulerHeartbeat("s1", paired_rooms=[room], prefill_rooms=[Room("p1", 1, 16, tp=2)])
    assert decode(encode(beat)) == beat
    for field_name, key, value in [
        ("paired_rooms", "tp", 0),
        ("prefill_rooms", "tp", 10**6),
        ("paired_rooms", "prefill_workers", ["p"] * 65),
        ("prefill_rooms", "seats", -1),
        ("paired_rooms", "worker_id", "x" * 70_000),
    ]:
        body = msgpack.unpackb(encode(beat), raw=False)
        body[field_name][0][key] = value
        with pytest.raises(MessageError):
            decode(msgpack.packb(body, use_bin_type=True))
