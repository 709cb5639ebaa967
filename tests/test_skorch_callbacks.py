"""Which of skorch's callbacks run on the main process only."""

import pytest
from skorch.callbacks import (
    Checkpoint,
    EarlyStopping,
    EpochScoring,
    EpochTimer,
    GradientNormClipping,
    LRScheduler,
    PrintLog,
    ProgressBar,
    TensorBoard,
    WandbLogger,
)
from skorch.callbacks.logging import MlflowLogger, NeptuneLogger, SacredLogger

from accel_mixin.training.notifications import main_process_only


class HistogramBoard(TensorBoard):
    """A user's logger, as skorch's TensorBoard docstring suggests."""


class Flagged(EarlyStopping):
    main_process_only = True


class Unflagged(TensorBoard):
    main_process_only = False


@pytest.mark.parametrize(
    "cls",
    [TensorBoard, WandbLogger, MlflowLogger, NeptuneLogger, SacredLogger, HistogramBoard, Flagged],
)
def test_loggers_run_on_the_main_process_only(cls):
    assert main_process_only(cls.__new__(cls))


@pytest.mark.parametrize(
    "cls",
    [
        EpochTimer,
        PrintLog,
        ProgressBar,
        EarlyStopping,
        Checkpoint,
        EpochScoring,
        GradientNormClipping,
        LRScheduler,
        Unflagged,
    ],
)
def test_other_callbacks_run_on_every_rank(cls):
    assert not main_process_only(cls.__new__(cls))
