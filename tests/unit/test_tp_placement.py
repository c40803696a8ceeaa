"""Tensor-parallel workers' cores: a worker's slice cut again among its ranks, pools shared out
in proportion to their ranks, a pool with fewer cores than ranks said aloud by `tandem up`, each
pool's degree in its workers' environment, and a colocated stack refusing a prefill degree."""

import os
from argparse import Namespace

from shared.cli import launcher, pools
from shared.cli.pools import sharing_notes, worker_specs
from shared.control.worker_roles import Mode
from shared.worker.placement import place
from shared.worker.tp_group import rank_cores


def args_of(**changes) -> Namespace:
    base = dict(
        mode=Mode.DISAGGREGATED,
        prefill=1,
        decode=1,
        gateways=1,
        prefill_tp=1,
        decode_tp=1,
        prefill_cpus="",
        decode_cpus="",
        no_pin=False,
        prefill_devices="",
        decode_devices="",
    )
    return Namespace(**{**base, **changes})


def test_a_worker_s_cores_are_cut_among_its_ranks():
    assert rank_cores([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert rank_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert rank_cores([4, 5], 3) == [[4], [5], [4]]  # fewer cores than ranks: shared in turn
    assert rank_cores([], 2) == [[], []]  # not placed


def test_pools_share_the_cores_in_proportion_to_their_ranks():
    args = args_of(prefill=2, prefill_tp=1, decode=1, decode_tp=3)
    assert pools._ranks(args) == {"prefill": 2, "decode": 3}  # the weights placement takes
    placement = place(list(range(10)), pools._ranks(args), {}, nodes=None)
    assert placement.pools == {"prefill": list(range(4)), "decode": list(range(4, 10))}
    assert rank_cores(placement.share_of("decode", 0, 1), 3) == [[4, 5], [6, 7], [8, 9]]


def test_a_pool_with_fewer_cores_than_ranks_is_said():
    cores = sorted(os.sched_getaffinity(0))
    one = str(cores[0])
    notes = sharing_notes(args_of(decode_tp=3, decode_cpus=one, prefill_cpus=one))
    assert len(notes) == 1 and "the decode pool has 1 core(s)" in notes[0]
    assert "3 tensor-parallel ranks (1 worker(s) x tp 3): its ranks share cores" in notes[0]
    assert sharing_notes(args_of(decode_cpus=one, prefill_cpus=one)) == []  # no TP: no note


def test_each_pool_s_degree_reaches_its_workers_and_threads_are_shared_out():
    specs = worker_specs(args_of(prefill_tp=2, decode_tp=3, no_pin=True), {}, _roles())
    assert specs["prefill"].env["TANDEM_TP"] == "2" and specs["decode"].env["TANDEM_TP"] == "3"
    if "TANDEM_TORCH_THREADS" not in os.environ:  # five ranks share the machine's cores
        per_rank = max(1, (os.cpu_count() or 1) // 5)
        assert specs["prefill"].env["TANDEM_TORCH_THREADS"] == str(2 * per_rank)
        assert specs["decode"].env["TANDEM_TORCH_THREADS"] == str(3 * per_rank)


def test_a_colocated_stack_refuses_a_prefill_degree():
    args = args_of(mode=Mode.COLOCATED, prefill_tp=2, secure=False, nats_url="", insecure=False)
    args.api_keys_file = ""
    assert "--decode-tp" in launcher._refusal(args)
    args.prefill_tp, args.decode_tp = 1, 0
    assert "at least 1" in launcher._refusal(args)
    args.decode_tp, args.gateways = 1, 0
    assert "--gateways must be at least 1" in launcher._refusal(args)


def _roles() -> dict:
    return {"prefill": {}, "decode": {}, "scheduler": {}, "gateway": {}}
