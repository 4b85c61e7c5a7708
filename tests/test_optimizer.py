"""The learning-rate schedule: warmup, cosine decay to `optimizer.decay_steps`, then the floor."""

import numpy as np
import pytest

from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.job.optimizer import learning_rate, schedule_change


def lrs(*overrides: str) -> list[float]:
    config = config_lib.load(None, ["optimizer.lr=1e-3", "optimizer.min_lr_ratio=0.1", *overrides])
    return [float(learning_rate(config)(step)) for step in range(config.train.steps)]


def test_lr_stays_at_the_floor_after_decay_steps():
    lr = lrs("train.steps=20", "optimizer.warmup_steps=4", "optimizer.decay_steps=12")
    assert max(lr) == pytest.approx(1e-3)
    assert np.all(np.diff(lr[4:13]) < 0)  # cosine decay from the peak ...
    assert lr[12:] == [lr[12]] * 8 and lr[12] == pytest.approx(1e-4, rel=1e-6)  # ... then the floor


def test_null_decay_steps_decays_over_train_steps():
    assert lrs("train.steps=20", "optimizer.warmup_steps=4") == lrs("train.steps=20", "optimizer.warmup_steps=4",
                                                                   "optimizer.decay_steps=20")


def test_schedule_change_names_keys_old_and_new_and_the_next_lr():
    saved = config_lib.load(None, ["train.steps=40"]).to_dict()
    longer = config_lib.load(None, ["train.steps=50"])
    line = schedule_change(saved, longer, 40)
    assert "optimizer.decay_steps 40 -> 50 (null: follows train.steps)" in line
    assert "step 41 gets lr 3.00e-04 under the checkpoint's schedule, 6.95e-04 under this run's" in line
    assert "optimizer.decay_steps=40 keeps" in line
    assert schedule_change(saved, config_lib.load(None, ["train.steps=50", "optimizer.decay_steps=40"]), 40) is None
    lower = schedule_change(saved, config_lib.load(None, ["train.steps=40", "optimizer.lr=1e-3"]), 40)
    assert "optimizer.lr 0.003 -> 0.001" in lower and "decay_steps" not in lower


def test_checkpoint_without_decay_steps_reads_as_train_steps():
    saved = config_lib.load(None, ["train.steps=40"]).to_dict()
    del saved["optimizer"]["decay_steps"]  # written before the key existed
    assert schedule_change(saved, config_lib.load(None, ["train.steps=40"]), 40) is None


def test_warmup_as_long_as_the_decay_goes_straight_to_the_floor():
    assert lrs("train.steps=6", "optimizer.warmup_steps=3", "optimizer.decay_steps=3")[3:] == [pytest.approx(1e-4)] * 3
