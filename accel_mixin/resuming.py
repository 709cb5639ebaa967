"""Resuming from a training state, as a sequence of named steps.

In the order Lightning's checkpoint connector follows, each step a
collective section that fails on every rank if it fails on one:

1. read the state once, on every rank;
2. load the weights into the unwrapped modules;
3. prepare them (or rewrap them);
4. restore optimizers, schedulers, gradient scaler, history, loop and
   callbacks;
5. free the state and wait for every rank.

The random number generators and the shuffling of the training data wait in
the net's process state until the next epoch begins; the next ``fit`` trains
the epochs that remain.
"""
from accel_mixin.checkpoint import restore_training_state, restore_weights, validate_state
from accel_mixin.files import read_state

__all__ = ['resume']


def resume(net, path):
    """Restore the training state at ``path`` into the initialized ``net``."""
    process, coordinator = net._process, net._coordinator  # pylint: disable=protected-access
    # a load that fails halfway leaves no earlier load to go on from
    process.forget_loaded_state()
    state = coordinator.run(lambda: _read(net, path), what='load_state')
    was_wrapped = _load_weights(net, state, path)
    _prepare(net, was_wrapped)
    pending = coordinator.run(lambda: restore_training_state(net, state, path),
                              what='load_state')
    del state  # before the wait: the largest object of the load
    process.pending = pending
    process.resumed = {'stopped': pending.pop('stopped', False)}
    coordinator.barrier('load_state')


def _read(net, path):
    # unmapped: optimizers keep the loaded tensors
    state = read_state(path, torch_load_kwargs=net.torch_load_kwargs, mmap=False)
    validate_state(state, path)
    return state


def _load_weights(net, state, path):
    """Load the weights into the unwrapped modules; return whether the net
    is to be wrapped afterwards."""
    prepared = net._prepared  # pylint: disable=protected-access
    # a net never prepared ends prepared, as initialize() leaves it
    was_wrapped = prepared.wrapped or not len(prepared)
    net._unwrap_accelerator()  # pylint: disable=protected-access
    net._coordinator.run(  # pylint: disable=protected-access
        lambda: restore_weights(net, state, path), what='load_state')
    return was_wrapped


def _prepare(net, was_wrapped):
    """Prepare what is new and rewrap; at train begin (``ResumeTraining``),
    the net prepares itself once the callbacks have built what they build."""
    if net._process.in_train_begin:  # pylint: disable=protected-access
        return
    net._initialize_accelerator()  # pylint: disable=protected-access
    if not was_wrapped:
        net._unwrap_accelerator()  # pylint: disable=protected-access
