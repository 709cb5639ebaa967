"""Training-state checkpoints: everything a run needs to go on as if it had
never stopped.

A training state is one torch file: the weights of every module and
criterion, every optimizer, the LR schedulers of ``LRScheduler`` callbacks,
the gradient scaler, the random number generators of every rank, the
history, the position of training (epochs done, gradient accumulation, the
training dataloader's shuffling) and the fitted state of the callbacks. It
holds only tensors and plain Python values, so it loads with
``weights_only=True``.

Restoring follows Lightning's order, as steps the mixin calls by name: read
the file once; load the weights into the unwrapped modules; prepare; restore
optimizers, schedulers, scaler, history, loop and callbacks; free the file's
state and wait for everyone. Random number generators and the dataloader's
shuffling are restored at the start of the next epoch, after ``fit`` has set
up its data, as the uninterrupted run had them there.
"""

import warnings

from accelerate.utils import gather_object
from skorch.callbacks import EarlyStopping, LRScheduler
from skorch.history import History

from accel_mixin.checkpoint.params import load_optimizer_state
from accel_mixin.checkpoint.state_dict import (
    clean_state_dict,
    load_module_state,
    strip_wrapper_prefixes,
)
from accel_mixin.checkpoint.state_values import as_plain, history_state, rng_state
from accel_mixin.errors import CheckpointError
from accel_mixin.resume.callback_state import callback_state
from accel_mixin.resume.loader_rng import generator_states
from accel_mixin.resume.mid_epoch import partial_epoch
from accel_mixin.resume.resume_plan import BEST_IS_CURRENT, BEST_WEIGHTS, ResumePlan
from accel_mixin.training.net_objects import net_modules, raw, raw_scheduler

__all__ = [
    "FORMAT",
    "collect_state",
    "restore_training_state",
    "restore_weights",
    "validate_state",
]

FORMAT = "accel_mixin.resume.training_state"
VERSION = 1


def _schedulers(net):
    for name, cb in net.callbacks_:
        if isinstance(cb, LRScheduler):
            yield name, cb


def warn_if_inside_accumulation(accelerator):
    """Say so on the main process where a state saved now misses gradients:
    those accumulated since the last optimizer step, which no state holds."""
    # accelerate counts the batches since the last sync in its own step
    # (0 at a dataloader's end with sync_with_dataloader); the gradient
    # state's flags are shared by every Accelerator of the process
    steps = accelerator.gradient_accumulation_steps
    if steps > 1 and accelerator.step % steps and accelerator.is_main_process:
        warnings.warn(
            "The training state is saved inside a window of gradient accumulation (without "
            "sync_with_dataloader, windows run on over an epoch's end): the gradients "
            "accumulated in it are not saved, so a run resumed from it steps where the "
            "uninterrupted one does, but without them, and does not repeat it exactly. "
            "Keep sync_with_dataloader=True for exact resumes.",
            RuntimeWarning,
        )


def collect_state(net, train_iterator_state, stopped=False, position=None):
    """The training state of ``net``; every rank calls it (for the RNGs).

    Parameters
    ----------
    net : AccelerateMixin net
      Initialized.

    train_iterator_state : dict
      What decides the shuffling of the next epoch, or inside an epoch, of
      that epoch.

    stopped : bool (default=False)
      Whether training stops after this epoch (``EarlyStopping``), so that
      a resumed run trains no further.

    position : tuple or None (default=None)
      Inside an epoch, ``(batches, batch_count)``: the training batches done
      in the epoch, and how many of them held real samples (``mid_epoch``).

    """
    accelerator = net.accelerator
    mine = {"rng": rng_state()}
    if position is not None:
        mine["partial"] = partial_epoch(net, position[1])
    everyone = [mine]
    if accelerator.num_processes > 1:
        everyone = gather_object(everyone)
    rows = net.history if position is None else net.history[:-1]
    schedulers = {}
    for name, cb in _schedulers(net):
        scheduler = raw_scheduler(name, cb, net)
        if scheduler is not None:
            # a plateau scheduler keeps the best score as skorch recorded it,
            # a NumPy float, which weights_only loading refuses
            schedulers[name] = as_plain(scheduler.state_dict())
    return {
        "format": FORMAT,
        "version": VERSION,
        "num_processes": accelerator.num_processes,
        "epoch": len(rows),
        "modules": {name: clean_state_dict(module) for name, module in net_modules(net)},
        "optimizers": {name: raw(net, name).state_dict() for name in net._optimizers},  # pylint: disable=protected-access
        "schedulers": schedulers,
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "rng": [item["rng"] for item in everyone],
        "history": history_state(rows),
        "callbacks": {name: _callback_state(net, name, cb) for name, cb in net.callbacks_},
        "loop": {
            "accumulation_step": int(accelerator.step),
            "train_iterator": train_iterator_state,
            "stopped": bool(stopped),
            # inside an epoch: the batches done, and each rank's part of it
            "batches": position[0] if position is not None else 0,
            "partial_epoch": (
                [item["partial"] for item in everyone] if position is not None else None
            ),
        },
    }


def _callback_state(net, name, cb):
    # EarlyStopping(load_best=True) keeps a copy of the best weights; a state
    # holds it only where it differs from the weights saved anyway
    state = callback_state(cb, name, warn=net.accelerator.is_main_process)
    if isinstance(cb, EarlyStopping) and state.get(BEST_WEIGHTS) is not None:
        current = cb.best_epoch_ == net.history[-1, "epoch"]
        state[BEST_IS_CURRENT] = current
        # under the keys of the bare module, which fit any process layout
        state[BEST_WEIGHTS] = None if current else strip_wrapper_prefixes(state[BEST_WEIGHTS])
    return state


def validate_state(state, source):
    """Refuse anything but a training state of a version we read."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{source} is not a training state written by save_state; files of "
            "save_params load with load_params."
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"{source} is a training state of version {state.get('version')}; this "
            f"accel_mixin reads version {VERSION}."
        )


def restore_weights(net, state, source):
    """Load every module and criterion; the net must be unwrapped."""
    saved = state["modules"]
    for name, module in net_modules(net):
        if name not in saved:
            raise CheckpointError(
                f"{source} holds no state for {name}_ (it holds {sorted(saved)}): it was "
                "saved from a net with other modules."
            )
        load_module_state(module, saved[name], source=source, name=name + "_")


def restore_training_state(net, state, source):
    """Restore optimizers, scaler, history, loop and callbacks.

    Returns the ``ResumePlan`` of what can only be restored during the next
    fit: the callbacks' and schedulers' state once training begins, the
    random number generators and the data's order once the epoch begins.

    """
    accelerator = net.accelerator
    for name in net._optimizers:  # pylint: disable=protected-access
        if name not in state["optimizers"]:
            raise CheckpointError(f"{source} holds no state for {name}_.")
        load_optimizer_state(
            raw(net, name), state["optimizers"][name], source=source, name=name + "_"
        )
    if state["scaler"] is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    net.history = History(state["history"])

    rngs = state["rng"]
    rank = accelerator.process_index
    if state["loop"].get("batches", 0) and len(rngs) != accelerator.num_processes:
        raise CheckpointError(
            f"{source} was saved inside an epoch by {len(rngs)} process(es); each of them "
            f"holds its own part of that epoch, so it resumes on {len(rngs)} processes only, "
            f"not on {accelerator.num_processes}. Resume from a training state of an epoch's "
            "end (training-state-<epoch>.pt) instead."
        )
    if len(rngs) != accelerator.num_processes and accelerator.is_main_process:
        warnings.warn(
            f"{source} was saved by {len(rngs)} process(es) and resumes on "
            f"{accelerator.num_processes}: weights, optimizers and history continue, but "
            "the random number streams differ from the run that saved it, so the "
            "resumed run will not repeat it exactly.",
            RuntimeWarning,
        )
    loop = state["loop"]
    plan = ResumePlan(
        stopped=loop.get("stopped", False),
        # after on_train_begin, which starts every fit at step 0
        accumulation_step=loop["accumulation_step"],
        callbacks=state["callbacks"],
        schedulers=state["schedulers"],
        optimizer_groups={
            name: optimizer["param_groups"] for name, optimizer in state["optimizers"].items()
        },
        rng=rngs[rank] if rank < len(rngs) else None,
        train_iterator=loop["train_iterator"],
    )
    if loop.get("batches", 0):
        # the RNGs are those after the last batch done, for the first resumed one
        plan.partial_epoch = dict(
            loop["partial_epoch"][rank], batches=loop["batches"], rng=plan.rng
        )
        plan.rng = None
    return plan


def train_iterator_state(train_iterator):
    """What decides the shuffling of the next epoch of ``train_iterator``:
    its generators (``loader_rng``) and accelerate's count of its epochs."""
    return {
        "generators": generator_states(train_iterator),
        "iteration": getattr(train_iterator, "iteration", None),
    }
