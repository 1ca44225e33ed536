"""TeraIO's micro-batch search (``workload.micro_batch_size: auto``): the order, the stopping
rule, out-of-memory candidates and the record; the end-to-end choice is in
test_teraio_train.py."""
import pytest

from teraio.trainer.microbatch import Candidate, MicroBatchSearch, divisors


def search(outcomes: dict, batch_size: int = 8, max_profiles: int = 3) -> MicroBatchSearch:
    """Run the search against scripted outcomes: micro-batch -> (ideal s, simulated s) or "oom"."""
    s = MicroBatchSearch(batch_size, max_profiles)
    step = 1
    while (m := s.next()) is not None:
        o = outcomes[m]
        s.add(Candidate(m, "oom", profile_step=step) if o == "oom"
              else Candidate(m, "simulated", o[0], o[1], step))
        step += 1
    return s


def test_divisors_largest_first():
    assert divisors(8) == [8, 4, 2, 1] and divisors(6) == [6, 3, 2, 1] and divisors(1) == [1]
    with pytest.raises(ValueError, match="batch_size=0"):
        divisors(0)


def test_the_shortest_simulated_iteration_wins_within_three_profiles():
    # 8 stalls on the drive, 4 hides most of it, 2 is slower in compute; 1 is never profiled
    s = search({8: (1.0, 3.0), 4: (1.1, 1.3), 2: (1.25, 1.35), 1: (2.0, 2.0)})
    assert [c.micro_batch_size for c in s.tried] == [8, 4, 2]
    assert s.best().micro_batch_size == 4
    rec = s.record()
    assert rec["chosen"] == 4 and [c["simulated_seconds"] for c in rec["candidates"]] == [3.0, 1.3, 1.35]


def test_no_smaller_candidate_is_profiled_once_one_runs_at_its_ideal():
    # 8 runs at its op time: a smaller micro-batch cannot be faster, so nothing else is profiled
    s = search({8: (1.0, 1.0)})
    assert [c.micro_batch_size for c in s.tried] == [8] and s.record()["chosen"] == 8
    # after 2 (its ideal 1.3 above 4's simulated 1.2) no smaller one can win: 1 is not
    # profiled, even with room for a fourth profile
    s = search({8: (1.0, 3.0), 4: (1.1, 1.2), 2: (1.3, 1.3)})
    assert [c.micro_batch_size for c in s.tried] == [8, 4, 2] and s.best().micro_batch_size == 4
    s = search({8: (1.0, 3.0), 4: (1.1, 1.2), 2: (1.3, 1.3)}, max_profiles=4)
    assert [c.micro_batch_size for c in s.tried] == [8, 4, 2]


def test_a_candidate_out_of_memory_under_the_pager_is_recorded_and_the_next_tried():
    s = search({8: "oom", 4: (1.0, 2.0), 2: (1.5, 1.6)})
    assert [(c.micro_batch_size, c.status) for c in s.tried] == [(8, "oom"), (4, "simulated"), (2, "simulated")]
    assert s.best().micro_batch_size == 2
    with pytest.raises(RuntimeError, match=r"no candidate micro-batch fit .*\[8, 4, 2\]"):
        search({8: "oom", 4: "oom", 2: "oom"}).best()


def test_the_search_refuses_an_outcome_for_another_candidate():
    s = MicroBatchSearch(4)
    with pytest.raises(ValueError, match="micro_batch_size=2; the search expects 4"):
        s.add(Candidate(2, "simulated", 1.0, 1.0))
    with pytest.raises(ValueError, match="max_profiles=0"):
        MicroBatchSearch(4, 0)
