"""bench/plan_validation.py's figures: Spearman's rho with tied ranks, and a model's top-1 ratio, failures and
rounds from its record; bench/cpu_links.py's fit of the links."""

import math

import pytest

from bench.cpu_links import fit, ring_terms
from bench.plan_validation import ranks, spearman, summary


def test_ties_share_their_mean_rank_and_rho_matches_scipys_values():
    assert ranks([30, 10, 20, 10]).tolist() == [4.0, 1.5, 3.0, 1.5]
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # scipy.stats.spearmanr's statistics for the same pairs
    assert spearman([10, 20, 30, 40], [11, 35, 29, 50]) == pytest.approx(0.8)
    assert spearman([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]) == pytest.approx(0.19885368120992467)
    assert math.isnan(spearman([1], [2])) and math.isnan(spearman([1, 2], [5, 5]))


def test_the_top1_ratio_is_the_predicted_firsts_median_step_over_the_best_and_each_round_has_its_own():
    def candidate(settings, predicted_s, rounds_s):
        failed = None in rounds_s
        return {"settings": settings, "predicted_s": predicted_s, "rounds_s": rounds_s,
                "measured_s": None if failed else sorted(rounds_s)[1], "error": "RuntimeError: no" if failed else None}

    record = {"candidates": [candidate("a", 1.0, [0.6, 0.66, 0.5]), candidate("b", 2.0, [0.5, 0.6, 0.55]),
                             candidate("c", 3.0, [0.4, None, 0.4])],
              "verdicts": {"ranked": 3, "undecided": 2}, "seconds": 9.0}
    figures = summary(record)
    assert figures["ratio"] == pytest.approx(0.6 / 0.55)  # medians; c failed a round, so it does not count
    assert figures["by_round"] == pytest.approx([0.6 / 0.5, 0.66 / 0.6, 0.5 / 0.5])
    assert figures["rho"] == pytest.approx(-1.0)  # over the two that ran
    assert (figures["failed"], figures["undecided"], figures["ranked"]) == (1, 2, 3)
    assert figures["first_spread"] == pytest.approx(0.66 / 0.5) and figures["best_spread"] == pytest.approx(0.6 / 0.5)


def test_the_links_fit_recovers_the_latency_and_bandwidth_that_made_its_times():
    latency, bandwidth = 12e-6, 0.9e9
    rows = []
    for group in (2, 4, 8):
        for nbytes in (4, 4096, 2**20, 2**24):
            steps, sent = ring_terms(group, nbytes)
            rows.append((group, nbytes, steps * latency + sent / bandwidth))
    assert ring_terms(8, 800) == (14, 1400)
    assert fit(rows) == pytest.approx((latency, bandwidth), rel=1e-6)


def test_a_candidates_record_is_the_median_of_its_rounds_and_a_failed_round_fails_it(monkeypatch):
    from types import SimpleNamespace

    import nestor.orchestrator.planning.search as search_lib
    from bench.plan_validation import CASES, _record
    from nestor.orchestrator.planning.measure import Measured

    monkeypatch.setattr(search_lib, "label", lambda candidate: candidate)
    predicted = {"step_s": 1.0, "compute_s": 0.9, "within_host_s": 0.1, "across_hosts_s": 0.0}
    fast, flaky = (SimpleNamespace(candidate=name, verdict="ranked", predicted=predicted) for name in ("fast", "flaky"))
    plan = SimpleNamespace(ranked=[fast, flaky], judged=[fast, flaky], compiles=2, elapsed_s=1.0)
    rounds = [[Measured(fast, 0.3), Measured(flaky, 0.2)],  # each round in its own order, fastest first
              [Measured(flaky, error="RuntimeError: lost"), Measured(fast, 0.5)],
              [Measured(fast, 0.4), Measured(flaky, 0.25)]]
    record = _record(CASES[0], plan, rounds)
    first, second = record["candidates"]
    assert (first["settings"], first["rounds_s"], first["measured_s"], first["error"]) == ("fast", [0.3, 0.5, 0.4],
                                                                                          0.4, None)
    assert (second["rounds_s"], second["measured_s"]) == ([0.2, None, 0.25], None)
    assert second["error"] == "RuntimeError: lost"
    assert summary(record | {"seconds": 1.0})["failed"] == 1
