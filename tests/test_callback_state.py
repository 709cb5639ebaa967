"""What a callback keeps in a training state is what it declares: its own
state_dict()/load_state_dict(), or, for skorch's callbacks, the fitted
attributes that callback_state.SKORCH_STATE names. Nothing is scraped."""

import warnings

import numpy as np
import pytest
import torch
from skorch.callbacks import (
    Callback,
    EarlyStopping,
    EpochScoring,
    EpochTimer,
    LRScheduler,
    PrintLog,
)

from accel_mixin.callbacks import ResumeTraining, TrainingCheckpoint
from accel_mixin.resume.callback_state import callback_state, restore_callback_state


class Counting(Callback):
    """A callback of a user's, with state it declares."""

    def __init__(self):
        self.seen_ = 0

    def on_epoch_end(self, net, **kwargs):
        self.seen_ += 1

    def state_dict(self):
        return {"seen": self.seen_}

    def load_state_dict(self, state):
        self.seen_ = state["seen"]


class Undeclared(Callback):
    """A callback of a user's with fitted state it does not declare."""

    def __init__(self):
        self.count_ = 3
        self.cache_ = object()  # not data a file holds: not named


def test_skorch_callbacks_keep_what_the_table_names_and_nothing_else():
    cb = EarlyStopping().initialize()
    cb.misses_, cb.dynamic_threshold_, cb.best_epoch_ = 3, np.float64(0.25), 7
    cb.attribute_of_a_new_skorch_ = 1  # a release's new attribute is no state by itself
    state = callback_state(cb)
    assert state == {"misses_": 3, "dynamic_threshold_": 0.25, "best_epoch_": 7}
    fresh = EarlyStopping().initialize()
    restore_callback_state(fresh, state)
    assert (fresh.misses_, fresh.best_epoch_) == (3, 7)
    scoring = EpochScoring("accuracy")
    scoring.best_score_, scoring.y_preds_ = 0.9, [torch.ones(2)]
    assert callback_state(scoring) == {"best_score_": 0.9}  # the epoch's cache is no state
    scheduler = LRScheduler()
    scheduler.batch_idx_, scheduler.policy_ = 12, "StepLR"
    assert callback_state(scheduler) == {"batch_idx_": 12}


def test_a_subclass_of_a_skorch_callback_keeps_its_base_s_state():
    class Patient(EarlyStopping):
        pass

    cb = Patient().initialize()
    cb.misses_ = 2
    assert callback_state(cb)["misses_"] == 2


def test_a_callback_that_declares_its_state_round_trips():
    cb = Counting()
    cb.seen_ = 5
    state = callback_state(cb, warn=True)
    assert state == {"seen": 5}
    fresh = Counting()
    restore_callback_state(fresh, state)
    assert fresh.seen_ == 5


def test_an_undeclared_callback_keeps_nothing_and_the_main_process_hears_why():
    undeclared = Undeclared()
    with pytest.warns(UserWarning, match=r"callback counter \(.*Undeclared\).* count_\. Give"):
        assert callback_state(undeclared, "counter", warn=True) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per callback, whatever the filters
        assert callback_state(undeclared, "counter", warn=True) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callback_state(Undeclared(), "counter", warn=False) == {}  # other ranks


def test_skorch_callbacks_the_table_does_not_name_keep_nothing_silently():
    timer, log = EpochTimer(), PrintLog()
    timer.epoch_start_time_, log.first_iteration_ = 12.5, False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callback_state(timer, warn=True) == callback_state(log, warn=True) == {}


def test_the_checkpoint_callbacks_keep_nothing():
    assert callback_state(TrainingCheckpoint("d").initialize(), warn=True) == {}
    assert callback_state(ResumeTraining("d").initialize(), warn=True) == {}
