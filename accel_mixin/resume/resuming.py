"""Resuming from a training state, as a sequence of named steps.

In the order Lightning's checkpoint connector follows, each step a
collective section that fails on every rank if it fails on one:

1. read the state once, on every rank;
2. load the weights into the unwrapped modules;
3. prepare them (or rewrap them);
4. restore optimizers, schedulers, gradient scaler, history, loop and
   callbacks;
5. free the state and wait for every rank.

What goes back only during the next fit (the callbacks' state, the random
number generators, the order of the training data) waits in a
``ResumePlan`` (``resume_plan``), which that fit applies; a state saved
inside an epoch resumes that epoch where it was saved (``continue_epoch``,
``mid_epoch``).
"""

import functools

from accel_mixin.checkpoint.files import read_state
from accel_mixin.checkpoint.state_values import rng_state
from accel_mixin.resume.mid_epoch import apply_partial_epoch
from accel_mixin.resume.training_state import (
    restore_training_state,
    restore_weights,
    train_iterator_state,
    validate_state,
)
from accel_mixin.training.process_state import process_state

__all__ = ["begin_epoch", "continue_epoch", "resume"]


def resume(net, path):
    """Restore the training state at ``path`` into the initialized ``net``."""
    process = process_state(net)
    coordinator = process.coordinator_for(net.accelerator)
    # a load that fails halfway leaves no earlier load to go on from
    process.forget_loaded_state()
    state = coordinator.run(
        lambda: _read(net, path), what="load_state", files=str(path), io_timeout=net.io_timeout
    )
    was_wrapped = _load_weights(net, coordinator, state, path)
    _prepare(net, was_wrapped)
    plan = coordinator.run(
        functools.partial(restore_training_state, net, state, path), what="load_state"
    )
    del state  # before the wait: the largest object of the load
    process.plan = plan
    coordinator.barrier("load_state")


def _read(net, path):
    # unmapped: optimizers keep the loaded tensors
    state = read_state(path, torch_load_kwargs=net.torch_load_kwargs, mmap=False)
    validate_state(state, path)
    return state


def _load_weights(net, coordinator, state, path):
    """Load the weights into the unwrapped modules; return whether the net
    is to be wrapped afterwards."""
    prepared = process_state(net).prepared
    # a net never prepared ends prepared, as initialize() leaves it
    was_wrapped = prepared.wrapped or not len(prepared)
    net._unwrap_accelerator()  # pylint: disable=protected-access
    coordinator.run(lambda: restore_weights(net, state, path), what="load_state")
    return was_wrapped


def _prepare(net, was_wrapped):
    """Prepare what is new and rewrap, or leave the net unwrapped as it was
    (at train begin, where ``ResumeTraining`` loads, the callbacks set up on
    the unwrapped objects). A scheduler that a callback before
    ``ResumeTraining`` built is prepared here, before its state is restored
    into the raw scheduler that the wrapper steps: the same as after."""
    net._initialize_accelerator()  # pylint: disable=protected-access
    if not was_wrapped:
        net._unwrap_accelerator()  # pylint: disable=protected-access


def begin_epoch(net):
    """When an epoch begins, before the callbacks: restore the RNGs and the
    shuffling a resumed run saved (for a state from inside an epoch, those of
    that epoch's start), and keep the RNGs and the shuffling state this epoch
    begins with, for training states saved inside it.

    Returns
    -------
    partial : dict or None
      The unfinished epoch that a state from inside it holds.

    """
    process = process_state(net)
    fit = process.fit
    iterator = fit.running_train_iterator()
    partial = process.plan.at_epoch_begin(iterator) if process.plan is not None else None
    fit.epoch_start_iterator = train_iterator_state(iterator)
    fit.epoch_start_rng = rng_state()
    return partial


def continue_epoch(net, partial):
    """After the callbacks' ``on_epoch_begin``: the unfinished epoch's row
    and caches back, and its batches done to be skipped."""
    apply_partial_epoch(net, partial)
