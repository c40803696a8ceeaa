"""Subjects are namespaced by cluster, so two stacks can share one NATS server."""

from shared.control.subjects import Subjects


def all_subjects(s: Subjects) -> list[str]:
    return [
        s.heartbeat,
        s.discover,
        s.submit,
        s.status,
        s.cancel,
        s.decode_tasks("w1"),
        s.prefill_tasks("w1"),
        s.prefill_results("w1"),
        s.gateway_tokens("g1"),
        s.stream_replay("w1"),
        s.probe,
        s.scheduler_heartbeat,
        s.submit_to("s1"),
        s.scheduler_ping("s1"),
    ]


def test_every_subject_is_under_the_cluster_root():
    for subject in all_subjects(Subjects("blue")):
        assert subject.startswith("tandem.blue.")


def test_subjects_are_distinct_within_a_cluster():
    subjects = all_subjects(Subjects("blue"))
    assert len(set(subjects)) == len(subjects)


def test_two_clusters_share_no_subject():
    assert not set(all_subjects(Subjects("blue"))) & set(all_subjects(Subjects("green")))
    # A cluster name that is a prefix of another still gets its own subjects.
    assert not set(all_subjects(Subjects("a"))) & set(all_subjects(Subjects("ab")))


def test_per_worker_subjects_differ_by_worker():
    s = Subjects("c")
    assert s.decode_tasks("w1") != s.decode_tasks("w2") != s.prefill_tasks("w2")
    assert s.decode_tasks("w1") != s.prefill_results("w1")
    assert s.gateway_tokens("g1") == "tandem.c.gateway.g1.tokens"
