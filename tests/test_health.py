"""The health gate judges each state against the run's best, which a slow blow-up cannot drag along."""

import math

from nestor.orchestrator.config.schema import HEALTH_WINDOW as WINDOW
from nestor.orchestrator.loop.health import MIN_LOSSES, StateHealth, best_of


def test_a_slow_drift_that_a_recent_median_follows_is_refused_once_past_the_factor_of_the_best():
    gate = StateHealth(2.0, start_param_norm=25.0)
    for step in range(1, 31):  # a healthy start: the loss falls to 3, the norm stays
        assert gate.judge(step, {"loss": 5.0 - 2.0 * min(step, 20) / 20, "param_norm": 25.0}) is None
    assert gate.best.loss == 3.0 and gate.best.param_norm == 25.0
    loss, step, refused = 3.0, 30, None
    while refused is None:  # each step 3% worse than the last: never 10x a recent median
        step, loss = step + 1, loss * 1.03
        refused = gate.judge(step, {"loss": loss, "param_norm": 25.0})
    median = sorted(3.0 * 1.03 ** k for k in range(step - 30 - WINDOW + 1, step - 30 + 1))[WINDOW // 2]
    assert median > 6.0 and "its loss" in refused and "x the best, 3 at step" in refused
    assert step - 30 < 40  # refused within 40 steps of the drift's start


def test_the_norm_is_judged_from_the_first_step_against_the_state_the_run_started_from():
    gate = StateHealth(2.0, start_param_norm=25.0)
    assert gate.judge(1, {"loss": 5.5, "param_norm": 49.0}) is None
    refused = gate.judge(2, {"loss": 5.5, "param_norm": 51.0})
    assert refused == ("its parameter norm 51 is more than checkpoint.health_factor=2 x 25, the norm of the best "
                       "state (step 0)")


def test_one_hard_batch_is_no_blow_up_and_factor_0_judges_nothing():
    gate, off = StateHealth(2.0, start_param_norm=25.0), StateHealth(0.0, start_param_norm=25.0)
    for step in range(1, 40):
        loss = 30.0 if step % 10 == 0 else 3.0  # a batch 10x harder every 10 steps
        assert gate.judge(step, {"loss": loss, "param_norm": 25.0}) is None
        assert off.judge(step, {"loss": loss * step, "param_norm": 25.0 * step}) is None


def test_the_best_travels_with_a_checkpoint_so_a_resume_is_judged_against_it():
    gate = StateHealth(2.0, start_param_norm=25.0)
    for step in range(1, MIN_LOSSES + 1):
        gate.judge(step, {"loss": 4.0, "param_norm": 26.0})
    record = gate.record()
    assert record == {"loss": 4.0, "param_norm": 26.0, "best": {"loss": 4.0, "param_norm": 26.0, "step": MIN_LOSSES}}
    resumed = StateHealth(2.0, best_of(record))
    assert resumed.judge(MIN_LOSSES + 1, {"loss": 4.0, "param_norm": 53.0}) is not None  # its first step already
    assert best_of({}) is None and best_of(None) is None


def test_a_restored_state_is_broken_only_when_its_first_loss_is_not_finite():
    # a finite jump may be other data (a resume onto another corpus): the gate judges it as any state
    assert StateHealth.restored_state_is_broken(math.nan) and StateHealth.restored_state_is_broken(math.inf)
    assert not StateHealth.restored_state_is_broken(50.0)
