"""Break each module's behaviour on purpose and check that a test catches it.

An audit that can be repeated (repository tooling, not part of the package):
every entry of ``BREAKS`` replaces one exact snippet of a module of
``accel_mixin`` with a broken version (a barrier removed, the unscale skipped,
a write on every rank instead of the main process, ...), runs the tests that
claim that behaviour, and restores the file, whatever happens. A break counts
as caught only when pytest reports a failing test (exit status 1); a clean
pass means the tests would let the broken behaviour through, and a collection
error or a timeout proves nothing either.

Usage, from a clean checkout (the file a break edits must have no
uncommitted changes)::

    .venv/bin/python scripts/breaks.py            # every break
    .venv/bin/python scripts/breaks.py --list     # names and what they break
    .venv/bin/python scripts/breaks.py --only atomic_files-no-fsync stepping-no-unscale

It prints a markdown table and exits with status 1 if any break was not
caught. Each run's pytest output is kept under ``--logs`` (a temporary folder
by default) so that the failure of a caught break can be read: a test that
fails for another reason than the break is no proof.
"""

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from jobs import kill_job  # noqa: E402

ONE_PROCESS_TIMEOUT = 300
LAUNCHED_TIMEOUT = 900


@dataclasses.dataclass(frozen=True)
class Break:
    """One deliberate defect: ``old`` in ``file`` becomes ``new``.

    ``tests`` are pytest's arguments (test files or ids): those that claim the
    behaviour, and that should fail once it is broken.
    """

    name: str
    module: str
    breaks: str
    file: str
    old: str
    new: str
    tests: tuple
    timeout: int = ONE_PROCESS_TIMEOUT


def launched(*args, **kwargs):
    """A break whose tests launch several processes: a longer timeout."""
    return Break(*args, **kwargs, timeout=LAUNCHED_TIMEOUT)


MP = "tests/test_multiprocess.py::"
SYNC = "tests/test_sync.py::"
DIV = "tests/test_divergence.py::"
SCORES = "tests/test_epoch_scores.py::"
OS = "tests/test_object_store.py::"
FSDP = "tests/test_fsdp.py::"
COORDINATION = "tests/test_coordination.py::"
FSDP_STATE = "tests/test_fsdp_resume.py::"
RESUME = "tests/test_resume.py::"
FILES = "tests/test_files.py::"
EXAMPLES = "tests/test_examples.py::"
FAULTS = "tests/test_sharded_faults.py::"
OLD_FORMAT_FSDP = "tests/test_old_format.py::test_an_old_run_folder_resumes_exactly[fsdp-2]"

BREAKS = [
    # --- atomic_files -------------------------------------------------------------
    Break(
        "atomic_files-write-in-place",
        "atomic_files",
        "skip the atomic rename: write straight into the target",
        "accel_mixin/checkpoint/atomic_files.py",
        "            fd, tmp = _create_temporary(path)\n",
        "            fd, tmp = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666), path\n",
        ("tests/test_params.py",),
    ),
    Break(
        "atomic_files-no-fsync",
        "atomic_files",
        "skip the fsync of the written file before the rename",
        "accel_mixin/checkpoint/atomic_files.py",
        "            os.fsync(fd)  # the same file, however it was written\n",
        "",
        ("tests/test_params.py",),
    ),
    Break(
        "atomic_files-mode-not-restored",
        "atomic_files",
        "a replaced file gets the temporary file's mode, not its own",
        "accel_mixin/checkpoint/atomic_files.py",
        "            if mode != stat.S_IMODE(created.st_mode) or not mode & stat.S_IWUSR:\n",
        "            if False:\n",
        ("tests/test_params.py",),
    ),
    Break(
        "atomic_files-leftover-kept",
        "atomic_files",
        "a killed save's temporary file is kept by the next save of the file and by rotation",
        "accel_mixin/checkpoint/atomic_files.py",
        "                with contextlib.suppress(OSError):\n                    os.unlink(name)\n",
        "                pass\n",
        ("tests/test_params.py",),
    ),
    Break(
        "atomic_files-live-save-taken-for-leftover",
        "atomic_files",
        "a live save's temporary file counts as a leftover, which another save removes",
        "accel_mixin/checkpoint/atomic_files.py",
        "    try:\n        return _lock(fd)\n",
        "    try:\n        return True\n",
        ("tests/test_params.py",),
    ),
    Break(
        "atomic_files-temporary-not-locked",
        "atomic_files",
        "a save does not lock its temporary file: a concurrent save takes it for a leftover",
        "accel_mixin/checkpoint/atomic_files.py",
        "    _lock(fd)  # until the fd closes, after the rename\n",
        "    pass\n",
        ("tests/test_params.py",),
    ),
    Break(
        "atomic_files-concurrent-save-tears",
        "atomic_files",
        "a save whose temporary file another save replaced renames that one into place",
        "accel_mixin/checkpoint/atomic_files.py",
        "            if not _ours(tmp, created):\n                raise _concurrent(path)\n",
        "            pass\n",
        ("tests/test_params.py",),
    ),
    Break(
        "weights-unsafe-load",
        "weights",
        "load with weights_only=False: pickles may run code",
        "accel_mixin/checkpoint/weights.py",
        '{"weights_only": True} if torch_load_kwargs is None',
        '{"weights_only": False} if torch_load_kwargs is None',
        ("tests/test_resume.py::test_load_state_refuses_a_file_that_would_run_code",),
    ),
    Break(
        "atomic_files-record-beside-saves",
        "atomic_files",
        "every save leaves a record file beside the files it was given",
        "accel_mixin/checkpoint/atomic_files.py",
        "        for path, tmp, *_ in written:\n            os.replace(tmp, path)\n",
        "        for path, tmp, *_ in written:\n            os.replace(tmp, path)\n"
        '            open(os.path.join(_directory(path), ".accel_mixin-sets.json"), "a").close()\n',
        ("tests/test_params.py::test_save_params_writes_only_the_files_it_is_given",),
    ),
    # --- weights --------------------------------------------------------
    Break(
        "weights-no-prefix-strip",
        "weights",
        "drop the key prefix strip when loading",
        "accel_mixin/checkpoint/weights.py",
        "    state_dict = strip_wrapper_prefixes(state_dict)\n    expected",
        "    expected",
        ("tests/test_params.py",),
    ),
    Break(
        "weights-partial-prefix",
        "weights",
        "strip a prefix that only some keys carry",
        "accel_mixin/checkpoint/weights.py",
        "all(k.startswith(p) for k in state_dict)",
        "any(k.startswith(p) for k in state_dict)",
        ("tests/test_params.py",),
    ),
    Break(
        "weights-no-unwrap",
        "weights",
        "clean_state_dict keeps the wrapper's keys",
        "accel_mixin/checkpoint/weights.py",
        "    return unwrap_module(module).state_dict()",
        "    return module.state_dict()",
        ("tests/test_params.py", "tests/test_resume.py", "-m", "not multiprocess"),
    ),
    Break(
        "weights-plain-pickle-called-corrupt",
        "weights",
        "a plain pickle that would run code is called a corrupt file",
        "accel_mixin/checkpoint/weights.py",
        "        calls = [] if refused or not weights_only else _plain_pickle_calls(f) or []\n",
        "        calls = []\n",
        ("tests/test_params.py", "-k", "plain_pickle"),
    ),
    # --- params ------------------------------------------------------------
    Break(
        "params-separate-saves-refused",
        "params",
        "load_params refuses files saved apart (their times a minute apart), unlike skorch",
        "accel_mixin/checkpoint/params.py",
        "            self.files = self._files()\n",
        "            self.files = self._files()\n"
        "            times = [os.stat(f).st_mtime for f in self.files.values() if _is_zip(f)]\n"
        "            if times and max(times) - min(times) > 1:\n"
        '                raise CheckpointError("These files come from different saves")\n',
        ("tests/test_params.py::test_files_of_separate_saves_load_as_in_skorch",),
    ),
    Break(
        "params-plain-module-load",
        "params",
        "load_params loads modules without the prefix strip and key checks",
        "accel_mixin/checkpoint/params.py",
        "            load_module_state(self._obj, state, source=source, name=self._attr)\n",
        "            self._obj.load_state_dict(state)\n",
        ("tests/test_params.py",),
    ),
    Break(
        "params-unsafe-load",
        "params",
        "load_params loads with weights_only=False: pickles may run code",
        "accel_mixin/checkpoint/params.py",
        'load_kwargs = {"weights_only": True} if user_kwargs',
        'load_kwargs = {"weights_only": False} if user_kwargs',
        ("tests/test_params.py",),
    ),
    Break(
        "params-not-one-unit",
        "params",
        "save_params writes each file into place as skorch does, not as one unit",
        "accel_mixin/checkpoint/params.py",
        "            by_name = dict(zip(named, temporaries))\n",
        "            by_name = dict(zip(named, named.values()))\n",
        ("tests/test_params.py",),
    ),
    # --- training_step / stepping -------------------------------------------
    Break(
        "training_step-no-unscale",
        "stepping",
        "skip the unscale before on_grad_computed",
        "accel_mixin/net/mixin.py",
        "            stepper.unscale(self._optimizers_now())",
        "            (self._optimizers_now())",
        ("tests/test_divergence.py", "-m", "not multiprocess"),
    ),
    Break(
        "training_step-grads-on-micro-batches",
        "stepping",
        "notify on_grad_computed on every micro-batch, not only where optimizers step",
        "accel_mixin/net/mixin.py",
        "            if not stepper.sync_gradients:\n                return  # partial",
        "            if False:\n                return  # partial",
        ("tests/test_divergence.py", "-m", "not multiprocess"),
    ),
    Break(
        "training_step-zero-before-forward",
        "stepping",
        "zero the gradients before each forward: accumulation is lost",
        "accel_mixin/training/stepping.py",
        "        self.deferring = self.steps > 1 and not closures\n",
        "        self.deferring = False\n",
        ("tests/test_divergence.py", "tests/test_mixin.py", "-m", "not multiprocess"),
    ),
    Break(
        "stepping-skorch-backward-always",
        "stepping",
        "skorch's loss.backward() also with a gradient scaler or accumulation",
        "accel_mixin/net/steps.py",
        "        if stepper.plain_backward:\n",
        "        if True:\n",
        ("tests/test_stepping.py", "-m", "not multiprocess"),
    ),
    Break(
        "stepping-no-zeroing-after-the-window",
        "stepping",
        "with accumulation, the gradients are never zeroed after the step",
        "accel_mixin/net/steps.py",
        "                self._zero_grad_optimizer()  # skorch's zeroing, after the step\n",
        "                pass\n",
        ("tests/test_divergence.py", "tests/test_mixin.py", "-m", "not multiprocess"),
    ),
    launched(
        "stepping-double-unscale",
        "stepping",
        "several optimizers under a scaler: the scaler updates after each",
        "accel_mixin/training/stepping.py",
        "        if not held:\n            yield\n            return\n",
        "        if True:\n            yield\n            return\n",
        (
            "tests/test_stepping.py::test_several_optimizers_update_the_scaler_once",
            "tests/test_matrix.py::test_emulated_fp16_equals_fp32[fp16-accum1-two_optimizers]",
        ),
    ),
    launched(
        "stepping-closure-loss-not-averaged",
        "stepping",
        "LBFGS on several processes gets each rank's own loss",
        "accel_mixin/training/stepping.py",
        "        if self.num_processes == 1:\n            return step_fn\n",
        "        if True:\n            return step_fn\n",
        (MP + "test_closure_optimizers_step_alike_on_every_rank",),
    ),
    launched(
        "checkpointing-load-during-a-save",
        "checkpointing",
        "loads do not wait for the net's asynchronous save in flight",
        "accel_mixin/net/saving.py",
        "        self._coordinator.run(self._wait_for_my_saves, what=label)\n",
        "        self._coordinator.run(lambda: None, what=label)\n",
        (
            "tests/test_state_folder.py::test_a_load_waits_for_its_own_net_s_save_not_for_another_s",
            "tests/test_resume.py::test_loads_wait_for_asynchronous_saves_in_flight",
        ),
    ),
    launched(
        "checkpointing-named-files-wait-for-every-rank",
        "checkpointing",
        "save_params writes files given by name only once every rank arrived",
        "accel_mixin/net/saving.py",
        "        return 0 if named else None\n",
        "        return None\n",
        (FILES + "test_named_files_are_written_while_the_others_arrive",),
    ),
    launched(
        "checkpointing-file-object-written-early",
        "checkpointing",
        "save_params writes a file object before the other ranks arrived",
        "accel_mixin/net/saving.py",
        "        return 0 if named else None\n",
        "        return 0\n",
        (FILES + "test_named_files_are_written_while_the_others_arrive",),
    ),
    launched(
        "checkpointing-synchronous-save-labelled-asynchronous",
        "checkpointing",
        "a synchronous save_state names its failures 'asynchronous save_state'",
        "accel_mixin/net/saving.py",
        '            self._finish_saves("save_state")\n',
        '            self._finish_saves("asynchronous save_state")\n',
        (
            "tests/test_mid_epoch.py::"
            "test_a_synchronous_save_inside_an_epoch_names_itself_when_a_rank_is_gone",
        ),
    ),
    # --- history_sync / epochs -----------------------------------------------
    Break(
        "history_sync-rank-order",
        "history_sync",
        "merge the ranks' records rank after rank, not in dataset order",
        "accel_mixin/distributed/history_sync.py",
        "for i in range(longest) for items in per_rank if i < len(items)]",
        "for items in per_rank for i in range(longest) if i < len(items)]",
        ("tests/test_history_sync.py",),
    ),
    Break(
        "history_sync-distributed-history-records",
        "history_sync",
        "leave skorch's DistributedHistory in place: it records through its store",
        "accel_mixin/distributed/history_sync.py",
        "    net.history_ = wrapped_history(history)\n",
        "    pass\n",
        ("tests/test_distributed_history.py", "-m", "not multiprocess"),
    ),
    Break(
        "history_sync-cut-scalars",
        "history_sync",
        "cut 0-d tensors of a model output too",
        "accel_mixin/distributed/history_sync.py",
        "tensor[:n] if tensor.dim() else tensor",
        "tensor[:n]",
        ("tests/test_history_sync.py",),
    ),
    Break(
        "history_sync-notice-on-every-rank",
        "history_sync",
        "say that the DistributedHistory is not needed on every rank",
        "accel_mixin/distributed/history_sync.py",
        "    if net.accelerator.is_main_process:\n        warnings.warn(NOTICE",
        "    if True:\n        warnings.warn(NOTICE",
        ("tests/test_distributed_history.py", "-m", "not multiprocess"),
    ),
    launched(
        "history_sync-keep-padding-batches",
        "history_sync",
        "drop the padding removal: padding-only batches stay in the history",
        "accel_mixin/distributed/history_sync.py",
        "if not _padding_only(batch)\n",
        "if True\n",
        (SYNC + "test_padding_only_batches_are_neither_kept_nor_counted",),
    ),
    # --- epoch_scores --------------------------------------------------------
    launched(
        "epoch_scores-each-rank-scores-its-share",
        "epoch_scores",
        "score cached predictions on every rank, each on its own share",
        "accel_mixin/distributed/epoch_scores.py",
        "    on_main = [(name, cb) for name, cb in scorers if not everywhere(cb)]\n",
        "    on_main, scorers = [], []\n",
        (SCORES + "test_every_rank_records_one_process_s_scores",),
    ),
    launched(
        "epoch_scores-rank-order",
        "epoch_scores",
        "put the ranks' predictions rank after rank, not in dataset order",
        "accel_mixin/distributed/epoch_scores.py",
        "            cb.y_preds_ = interleave([rank[index][0] for rank in everyone])\n",
        "            cb.y_preds_ = [p for rank in everyone for p in rank[index][0]]\n",
        (SCORES + "test_cached_predictions_are_scored_once_on_the_main_process",),
    ),
    launched(
        "epoch_scores-padding-scored",
        "epoch_scores",
        "send the predictions of batches of padding alone too",
        "accel_mixin/distributed/epoch_scores.py",
        "        [item for item, keep in zip(cached, real) if keep]",
        "        list(cached)",
        (SCORES + "test_nested_outputs_of_any_dtype_reach_the_main_process",),
    ),
    launched(
        "epoch_scores-error-not-sent",
        "epoch_scores",
        "keep a scorer's error on the main process: the others record nothing",
        "accel_mixin/distributed/epoch_scores.py",
        "        name: (score, error and DistributedError(error)) for name, (score, error) in sent",
        "        name: (score, None) for name, (score, error) in sent",
        (SCORES + "test_a_scorer_s_error_on_the_main_process_reaches_every_rank_at_once",),
    ),
    Break(
        "epoch_scores-unaligned",
        "epoch_scores",
        "pack tensors back to back, without aligning their starts",
        "accel_mixin/distributed/epoch_scores.py",
        "    return -(-n // _ALIGN) * _ALIGN",
        "    return n",
        (
            SCORES + "test_a_layout_and_its_bytes_give_back_the_items",
            SCORES + "test_small_tensors_travel_together_and_large_ones_alone",
        ),
    ),
    Break(
        "epoch_scores-overrides-scored-on-main",
        "epoch_scores",
        "score a subclass that overrides on_epoch_end on the main process too",
        "accel_mixin/distributed/epoch_scores.py",
        "        getattr(type(cb), m) is not getattr(EpochScoring, m) for m in",
        "        False for m in",
        (SCORES + "test_which_scorers_need_the_whole_predictions_on_every_rank",),
    ),
    launched(
        "epochs-loss-of-padding",
        "epochs",
        "record the loss of padded batches, padding included",
        "accel_mixin/training/epochs.py",
        "    return dict(step, loss=loss, y_pred=y_pred)",
        "    return dict(step, y_pred=y_pred)",
        (SYNC + "test_scores_equal_one_process_on_the_whole_validation_set",),
    ),
    launched(
        "epochs-no-replica-check",
        "epochs",
        "skip the replica check after an epoch",
        "accel_mixin/training/epochs.py",
        '            compare_replicas(prints, names, f"after epoch {len(net.history)}")\n',
        "            pass\n",
        (DIV + "test_replica_check_raises_on_every_rank_naming_the_parameter_and_epoch",),
    ),
    # --- replicas ----------------------------------------------------------
    Break(
        "replicas-fingerprint-first-word",
        "replicas",
        "fingerprint only the first word of each tensor",
        "accel_mixin/distributed/replicas.py",
        "_words(tensor.reshape(-1)).sum(dtype=torch.int32)",
        "_words(tensor.reshape(-1))[:1].sum(dtype=torch.int32)",
        ("tests/test_divergence.py", "-m", "not multiprocess"),
    ),
    launched(
        "replicas-no-same-data-check",
        "replicas",
        "skip the check that every rank fits on data of the same length",
        "accel_mixin/distributed/replicas.py",
        "    if any(lengths[:2] != everyone[0][:2] for lengths in everyone):",
        "    if False:",
        ("tests/test_divergence.py", "-k", "data_of_other_lengths"),
    ),
    launched(
        "replicas-no-same-values-check",
        "replicas",
        "skip the check that the same rows hold the same values on every rank",
        "accel_mixin/distributed/replicas.py",
        "    if -1 not in digests and len(set(digests)) > 1:",
        "    if False:",
        ("tests/test_divergence.py", "-k", "data_of_other_values"),
    ),
    Break(
        "fork_guard-forks-unguarded",
        "fork_guard",
        "let a fork go ahead while a native thread runs",
        "accel_mixin/distributed/fork_guard.py",
        "            if first == second and not any(running for running, _ in second.values()):",
        "            if True:",
        ("tests/test_fork_guard.py", "-m", "not multiprocess"),
    ),
    # --- net_objects / wrapping ----------------------------------------------
    launched(
        "net_objects-no-reprepare",
        "net_objects",
        "skip re-preparing a module whose trainable parameters changed",
        "accel_mixin/training/net_objects.py",
        "    if refresh:\n        prepared.prepare(",
        "    if False:\n        prepared.prepare(",
        (DIV + "test_freezer_after_prepare_trains_one_model",),
    ),
    Break(
        "wrapping-unwrap-keeps-autocast",
        "wrapping",
        "unwrapping leaves accelerate's autocast patch on the raw module",
        "accel_mixin/training/wrapping.py",
        "                entry.marks = pop_marks(entry.raw)\n",
        "                pass\n",
        ("tests/test_wrapping.py",),
    ),
    Break(
        "wrapping-lists-keep-unwrapped",
        "wrapping",
        "unwrapping leaves the objects on the accelerator's lists",
        "accel_mixin/training/wrapping.py",
        "        _release(self._held)\n        self.wrapped = False",
        "        self.wrapped = False",
        ("tests/test_wrapping.py",),
    ),
    # --- internals -----------------------------------------------------------
    Break(
        "internals-no-list-check",
        "internals",
        "accept an accelerator whose private lists are gone",
        "accel_mixin/internals.py",
        "        present = isinstance(getattr(accelerator, name, None), list)\n",
        "        present = True\n",
        ("tests/test_internals.py",),
    ),
    # --- mixin ---------------------------------------------------------------
    launched(
        "mixin-no-gather",
        "mixin",
        "predict returns this rank's rows only",
        "accel_mixin/net/steps.py",
        "        return self.accelerator.gather_for_metrics(y_infer)",
        "        return y_infer",
        (MP + "test_predict_returns_every_row_in_order",),
    ),
    launched(
        "stepping-no-padding-across-ranks",
        "stepping",
        "gather outputs of other lengths on each rank as they are",
        "accel_mixin/net/steps.py",
        "            y_infer = pad_to_largest(y_infer)",
        "            pass",
        ("tests/test_sync.py", "-k", "other_lengths"),
    ),
    launched(
        "mixin-inference-warns-everywhere",
        "mixin",
        "warnings of inference appear on every rank",
        "accel_mixin/net/steps.py",
        "        with quiet_unless_main(self.accelerator):\n            yield from",
        "        if True:\n            yield from",
        (SYNC + "test_one_voice",),
    ),
    Break(
        "net_objects-device-not-refused",
        "net_objects",
        "accept device= while the accelerator places the objects",
        "accel_mixin/training/net_objects.py",
        "    if accelerator.device_placement and net.device is not None:",
        "    if False:",
        ("tests/test_mixin.py",),
    ),
    # --- checkpointing / process_layout ---------------------------------------
    launched(
        "process_layout-every-rank-writes",
        "process_layout",
        "swap the main-process check: every rank writes the files",
        "accel_mixin/distributed/process_layout.py",
        "        return accelerator.is_local_main_process\n    return accelerator.is_main_process",
        "        return accelerator.is_local_main_process\n    return True",
        (MP + "test_only_the_main_process_writes",),
    ),
    launched(
        "process_layout-one-writer-per-cluster",
        "process_layout",
        "with save_on_each_node, only the global main process writes",
        "accel_mixin/distributed/process_layout.py",
        "        return accelerator.is_local_main_process\n",
        "        return accelerator.is_main_process\n",
        ("tests/test_files.py::test_two_machines_without_a_shared_filesystem",),
    ),
    Break(
        "process_layout-accept-one-process-group",
        "process_layout",
        "accept a launch where the accelerator sees one process of several",
        "accel_mixin/distributed/process_layout.py",
        "    if world_size <= 1 or accelerator.num_processes > 1:",
        "    if True:",
        ("tests/test_process_layout.py", "-m", "not multiprocess"),
    ),
    # --- process_layout (one voice) / skorch_callbacks / notifications -----
    Break(
        "process_layout-sink-swap-main-check",
        "process_layout",
        "swap the main-process check of the print sink",
        "accel_mixin/distributed/process_layout.py",
        "    return print if accelerator.is_main_process else silent",
        "    return silent if accelerator.is_main_process else print",
        ("tests/test_output.py",),
    ),
    Break(
        "process_layout-quiet-everywhere",
        "process_layout",
        "quiet_unless_main silences the main process, not the others",
        "accel_mixin/distributed/process_layout.py",
        "    if accelerator.is_main_process:\n        yield\n        return",
        "    if not accelerator.is_main_process:\n        yield\n        return",
        ("tests/test_output.py",),
    ),
    Break(
        "skorch_callbacks-printlog-main-only",
        "notifications",
        "PrintLog, ProgressBar, EpochTimer run on the main process only",
        "accel_mixin/training/notifications.py",
        "        ) and not issubclass(cls, _RUN_EVERYWHERE)",
        "        )",
        ("tests/test_skorch_callbacks.py",),
    ),
    launched(
        "skorch_callbacks-pickle-on-every-rank",
        "notifications",
        "every rank writes Checkpoint's f_pickle",
        "accel_mixin/training/notifications.py",
        "    if is_main_process:\n        yield\n        return\n    saved: list",
        "    if True:\n        yield\n        return\n    saved: list",
        (SYNC + "test_checkpoint_on_best_accuracy_decides_alike_and_writes_once",),
    ),
    launched(
        "notifications-loggers-on-every-rank",
        "notifications",
        "loggers run on every rank",
        "accel_mixin/training/notifications.py",
        "        if main or not main_process_only(cb)\n",
        "        if True\n",
        (SYNC + "test_tensorboard_records_each_value_once_from_the_main_process",),
    ),
    launched(
        "notifications-batch-failure-unreported",
        "notifications",
        "an error in a per-batch notification does not fail the enclosing section",
        "accel_mixin/net/mixin.py",
        "            batch_failed(self._coordinator, method_name, exc)\n",
        "            pass\n",
        (SYNC + "test_an_error_on_rank_1_reaches_rank_0_promptly",),
    ),
    launched(
        "notifications-no-barrier-after-begin",
        "notifications",
        "remove the barrier after on_train_begin and on_epoch_begin",
        "accel_mixin/training/notifications.py",
        "        if exc is None and self._name in _BARRIER_AFTER:\n",
        "        if False:  # pylint: disable=using-constant-test\n",
        (SYNC + "test_an_error_on_rank_1_reaches_rank_0_promptly",),
    ),
    # --- rng / plain_values / contents / load / plan -----------------------
    Break(
        "rng-no-torch-rng",
        "rng",
        "stop restoring torch's random number generator",
        "accel_mixin/training/rng.py",
        '    torch.set_rng_state(state["torch"])\n',
        "",
        ("tests/test_rng.py",),
    ),
    Break(
        "plain_values-snapshot-shares-memory",
        "plain_values",
        "the CPU snapshot of an asynchronous save shares the live tensors",
        "accel_mixin/checkpoint/plain_values.py",
        '        return tensor.to("cpu", copy=True)',
        '        return tensor.to("cpu")',
        ("tests/test_plain_values.py",),
    ),
    Break(
        "callback_state-scraped",
        "callback_state",
        "skorch's callbacks keep every fitted attribute, a release's new ones too",
        "accel_mixin/resume/callback_state.py",
        "        if cls in SKORCH_STATE:\n            return SKORCH_STATE[cls]\n",
        "        if cls in SKORCH_STATE:\n"
        "            return [key for key in vars(callback) if key.endswith('_')]\n",
        ("tests/test_callback_state.py",),
    ),
    Break(
        "callback_state-protocol-ignored",
        "callback_state",
        "a callback's own state_dict is not asked",
        "accel_mixin/resume/callback_state.py",
        '    if callable(getattr(callback, "state_dict", None)):\n        return',
        "    if False:\n        return",
        ("tests/test_callback_state.py",),
    ),
    Break(
        "callback_state-silent",
        "callback_state",
        "an undeclared callback's fitted state is dropped without a word",
        "accel_mixin/resume/callback_state.py",
        "        if fitted:\n",
        "        if False:\n",
        ("tests/test_callback_state.py",),
    ),
    Break(
        "contents-no-scaler",
        "contents",
        "stop restoring the gradient scaler",
        "accel_mixin/resume/load.py",
        '        accelerator.scaler.load_state_dict(state["scaler"])',
        "        pass",
        ("tests/test_resume.py", "-m", "not multiprocess"),
    ),
    launched(
        "contents-no-shuffling",
        "contents",
        "stop restoring the training data's shuffling",
        "accel_mixin/training/resumed_order.py",
        "            generator.set_state(state)",
        "            pass",
        # the resume matrix's loaders with a generator of their own catch it;
        # test_resume's runs shuffle with the global generator, which it leaves
        ("tests/test_resume_loaders.py",),
    ),
    launched(
        "loader_rng-persistent-workers-draw-again",
        "resumed_order",
        "a resumed fit's persistent workers draw their seed from the restored generators",
        "accel_mixin/training/epochs.py",
        "                    start_workers_without_draws(self.iterator)",
        "                    pass",
        ("tests/test_resume_loaders.py",),
    ),
    Break(
        "contents-no-scheduler",
        "contents",
        "stop restoring the LR schedulers",
        "accel_mixin/resume/plan.py",
        "                scheduler.load_state_dict(self.schedulers[name])",
        "                pass",
        ("tests/test_resume_order.py",),
    ),
    Break(
        "contents-no-accumulation-step",
        "contents",
        "stop restoring the gradient accumulation step",
        "accel_mixin/resume/plan.py",
        "        net.accelerator.step = self.accumulation_step\n",
        "",
        ("tests/test_resume.py", "tests/test_resume_order.py", "-m", "not multiprocess"),
    ),
    Break(
        "contents-open-window-silent",
        "contents",
        "a state saved inside a window of accumulation does not say it lacks the gradients",
        "accel_mixin/resume/contents.py",
        "    if steps > 1 and accelerator.step % steps and accelerator.is_main_process:\n",
        "    if False:\n",
        ("tests/test_resume.py", "-m", "not multiprocess"),
    ),
    Break(
        "contents-warns-outside-windows",
        "contents",
        "every saved state warns that it misses accumulated gradients",
        "accel_mixin/resume/contents.py",
        "    if steps > 1 and accelerator.step % steps and accelerator.is_main_process:\n",
        "    if accelerator.is_main_process:\n",
        ("tests/test_resume.py", "-m", "not multiprocess"),
    ),
    Break(
        "plan-retrain-every-epoch",
        "plan",
        "a resumed fit trains max_epochs again instead of those that remain",
        "accel_mixin/resume/plan.py",
        "        return max(net.max_epochs - len(net.history), 0)",
        "        return epochs",
        ("tests/test_resume.py", "-m", "not multiprocess"),
    ),
    Break(
        "plan-stopped-run-continues",
        "plan",
        "a run stopped by EarlyStopping is continued by a rerun",
        "accel_mixin/resume/plan.py",
        "                RuntimeWarning,\n            )\n            return 0",
        "                RuntimeWarning,\n            )\n"
        "            return max(net.max_epochs - len(net.history), 0)",
        ("tests/test_resume.py", "-m", "not multiprocess"),
    ),
    Break(
        "process_state-load-not-forgotten",
        "checkpointing",
        "a failed load_state leaves the previous load's state pending",
        "accel_mixin/net/saving.py",
        "        local.loaded = None  # a load that fails halfway",
        "        pass  # a load that fails halfway",
        ("tests/test_resume.py", "-m", "not multiprocess"),
    ),
    # --- resumed_order / positions / callbacks -------------------------------
    Break(
        "mid_epoch-no-skip",
        "resumed_order",
        "a resumed epoch trains its first batches again",
        "accel_mixin/training/resumed_order.py",
        "        for _ in range(self.skip):\n",
        "        for _ in range(0):\n",
        ("tests/test_mid_epoch.py", "-m", "not multiprocess"),
    ),
    launched(
        "mid_epoch-row-not-restored",
        "plan",
        "a resumed epoch loses the records of the batches done before",
        "accel_mixin/resume/plan.py",
        '    net.history[-1] = partial["row"]\n',
        "",
        ("tests/test_mid_epoch.py",),
    ),
    launched(
        "epochs-mid-epoch-rng",
        "epochs",
        "a resumed epoch does not restore the generators of its last batch",
        "accel_mixin/training/epochs.py",
        '                        restore_rng(self.resume["rng"])\n'
        "                        self.resume = None",
        "                        self.resume = None",
        ("tests/test_mid_epoch.py",),
    ),
    Break(
        "positions-drop-prefix",
        "positions",
        "drop the prefix of the epoch-end file names",
        "accel_mixin/checkpoint/positions.py",
        '    return f"training-state-{epoch:06d}"',
        '    return f"{epoch:06d}"',
        ("tests/test_resume.py", "-m", "not multiprocess"),
    ),
    Break(
        "positions-other-layouts",
        "positions",
        "states inside an epoch of another number of processes count",
        "accel_mixin/checkpoint/positions.py",
        "paths[-1][1] == processes\n",
        "True\n",
        ("tests/test_mid_epoch.py", "-m", "not multiprocess"),
    ),
    Break(
        "positions-oldest",
        "positions",
        "resume from the oldest common state, not the newest",
        "accel_mixin/checkpoint/positions.py",
        "        position = max(common)",
        "        position = min(common)",
        ("tests/test_resume.py", "tests/test_mid_epoch.py", "-m", "not multiprocess"),
    ),
    Break(
        "callbacks-rotation-keeps-more",
        "callbacks",
        "rotation keeps one file more than keep_last",
        "accel_mixin/callbacks.py",
        "checkpoint_files(folder)[: -self.keep_last]",
        "checkpoint_files(folder)[: -self.keep_last - 1]",
        ("tests/test_resume.py", "tests/test_mid_epoch.py", "-m", "not multiprocess"),
    ),
    Break(
        "callbacks-every-n-inverted",
        "callbacks",
        "save on the epochs every_n_epochs does not name",
        "accel_mixin/callbacks.py",
        "        if stop or not epoch % self.every_n_epochs:",
        "        if stop or epoch % self.every_n_epochs:",
        ("tests/test_resume.py", "-m", "not multiprocess"),
    ),
    # --- runs / preemption / portable ----------------------------------------
    Break(
        "describe-hashes-one-row",
        "describe",
        "an array is hashed by its first row: corrected data resumes the old run",
        "accel_mixin/resume/describe.py",
        '            "sha256": self._digest(_array_bytes(value)),',
        '            "sha256": self._digest(_array_bytes(value[:1])),',
        ("tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "describe-defaults-counted",
        "describe",
        "parameters at their defaults count: an upgrade that adds one starts a new run",
        "accel_mixin/resume/describe.py",
        "        if scratch(default) == described and not scratch.refusals:",
        "        if False:",
        ("tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "describe-refusals-forgotten",
        "describe",
        "a value that cannot be described is guessed equal to any other",
        "accel_mixin/resume/describe.py",
        "        self.refusals.append((path, reason))\n",
        "",
        ("tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "describe-dataset-rows-read-by-chance",
        "describe",
        "a Dataset's rows are read with the generators as they are: an augmenting Dataset "
        "fingerprints differently on every rank and takes draws from training",
        "accel_mixin/distributed/sample_rows.py",
        "        with fixed_random_state(generators):\n",
        "        with contextlib.nullcontext():\n",
        ("tests/test_runs.py", "tests/test_sample_rows.py", "-m", "not multiprocess"),
    ),
    Break(
        "describe-dataset-generators-by-state",
        "describe",
        "a generator a Dataset holds is described by its state: a Dataset seeded per rank "
        "makes the ranks fit different runs",
        "accel_mixin/resume/describe.py",
        "            if self._inside_datasets:\n",
        "            if False:\n",
        ("tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "runs-own-name-not-own-run",
        "runs",
        "run= with the fit's own run_name means another run of that name: other data "
        "under the name continues the old run",
        "accel_mixin/resume/runs.py",
        "    if own is not None and wanted in (own.key, own.id, own.name):\n",
        "    if False:\n",
        ("tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "callbacks-run-folder-at-train-begin",
        "callbacks",
        "the run folder is created at train begin: a fit that fails there leaves an empty "
        "run folder, one more run of its name",
        "accel_mixin/callbacks.py",
        "        self.run_folder_ = storage.join(dirname, self.run_.folder)\n",
        "        self.run_folder_ = storage.join(dirname, self.run_.folder)\n"
        "        storage.makedirs(self.run_folder_)\n",
        ("tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "runs-num-workers-counted",
        "runs",
        "more DataLoader workers start a new run",
        "accel_mixin/resume/runs.py",
        '        "num_workers",\n',
        "",
        ("tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "runs-max-epochs-in-identity",
        "runs",
        "raising max_epochs starts a new run",
        "accel_mixin/resume/runs.py",
        '        "max_epochs",\n',
        "",
        ("tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "preemption-handler-not-restored",
        "preemption",
        "the previous signal handlers are not put back",
        "accel_mixin/distributed/preemption.py",
        "            signal.signal(signum, old)",
        "            pass",
        ("tests/test_preemption.py", "-m", "not multiprocess"),
    ),
    launched(
        "preemption-min-not-max",
        "preemption",
        "a notice stops the ranks only when every rank got it",
        "accel_mixin/distributed/preemption.py",
        "dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)",
        "dist.all_reduce(values, op=dist.ReduceOp.MIN, async_op=True)",
        (
            "tests/test_preemption.py::test_a_notice_stops_every_rank_at_one_batch_and_the_"
            "rerun_resumes_exactly[2-notice_one]",
        ),
    ),
    launched(
        "preemption-interval-from-own-pace",
        "preemption",
        "the polls reduce the notice flag only: each rank schedules the next poll from its "
        "own pace, and the ranks' polls no longer match",
        "accel_mixin/distributed/preemption.py",
        "dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)",
        "dist.all_reduce(values[:1], op=dist.ReduceOp.MAX, async_op=True)",
        (
            "tests/test_preemption.py::test_with_polls_far_apart_every_rank_stops_at_one_batch_"
            "within_the_bound[skewed]",
        ),
    ),
    launched(
        "preemption-polling-when-one-rank-watches",
        "preemption",
        "the ranks stop polling unless every rank handles signals",
        "accel_mixin/distributed/preemption.py",
        "dist.all_reduce(flags, op=dist.ReduceOp.MAX)",
        "dist.all_reduce(flags, op=dist.ReduceOp.MIN)",
        (
            "tests/test_preemption.py::test_a_notice_stops_every_rank_at_one_batch_and_the_"
            "rerun_resumes_exactly[2-notice_mixed]",
        ),
    ),
    launched(
        "callbacks-polls-without-signals",
        "callbacks",
        "TrainingCheckpoint(signals=()) still polls for notices after every batch",
        "accel_mixin/callbacks.py",
        "        watching = can_handle(self.signals)",
        "        watching = True",
        (
            "tests/test_preemption.py::"
            "test_where_no_rank_handles_signals_no_rank_polls_after_the_first_batch",
        ),
    ),
    Break(
        "portable-drop-accumulation",
        "portable",
        "an unpickled net's accelerator loses gradient accumulation",
        "accel_mixin/training/portable.py",
        '        "gradient_accumulation_plugin": GradientAccumulationPlugin(\n'
        "            **accelerator.gradient_state.plugin_kwargs\n        ),\n",
        "",
        ("tests/test_portable.py",),
    ),
    # --- diagnostics / __main__ ------------------------------------------
    Break(
        "diagnostics-layout-always-ok",
        "diagnostics",
        "the report says the layout check passes without running it",
        "accel_mixin/diagnostics.py",
        "        check_process_layout(accelerator)\n",
        "",
        ("tests/test_diagnostics.py", "-m", "not multiprocess"),
    ),
    Break(
        "main-prints-nothing",
        "__main__",
        "python -m accel_mixin env prints no report",
        "accel_mixin/__main__.py",
        "        print(report, flush=True)",
        "        pass",
        ("tests/test_diagnostics.py", "-m", "not multiprocess"),
    ),
    # --- rows --------------------------------------------------------------
    Break(
        "rows-other-dtype",
        "rows",
        "rows are viewed as float32 whatever the array's dtype",
        "accel_mixin/training/rows.py",
        "        return torch.from_numpy(data)\n",
        "        return torch.from_numpy(data).float()\n",
        ("tests/test_rows.py",),
    ),
    Break(
        "rows-batch-targets-misaligned",
        "rows",
        "a batch fetched at once pairs each sample with another sample's target",
        "accel_mixin/training/rows.py",
        "        return list(zip(X_rows, _rows(self._y_rows, index)))\n",
        "        return list(zip(X_rows, _rows(self._y_rows, index.flip(0))))\n",
        ("tests/test_rows.py",),
    ),
    Break(
        "rows-dict-batch-keys-shuffled",
        "rows",
        "a batch of a dict of arrays fetched at once gives each sample its keys' rows out of order",
        "accel_mixin/training/rows.py",
        "        return [dict(zip(columns, row)) for row in zip(*columns.values())]\n",
        "        return [dict(zip(columns, row[::-1])) for row in zip(*columns.values())]\n",
        ("tests/test_rows.py",),
    ),
    Break(
        "rows-read-only-viewed",
        "rows",
        "read-only arrays are viewed too (torch warns where skorch did not)",
        "accel_mixin/training/rows.py",
        "    if not isinstance(data, np.ndarray) or not data.flags.writeable:\n",
        "    if not isinstance(data, np.ndarray):\n",
        ("tests/test_rows.py",),
    ),
    Break(
        "stepping-compiled-nll-unrecognised",
        "stepping",
        "a compiled NLLLoss stays compiled in get_loss: the classifier skips the log",
        "accel_mixin/training/stepping.py",
        "    if not isinstance(inner, torch.nn.NLLLoss):\n",
        "    if True:  # pylint: disable=using-constant-test\n",
        ("tests/test_mixin.py",),
    ),
    Break(
        "net-replaces-users-dataset",
        "net",
        "a skorch Dataset the user passed is replaced by tensor rows",
        "accel_mixin/net/mixin.py",
        "        if dataset is X or dataset is self.dataset:\n",
        "        if False:  # pylint: disable=using-constant-test\n",
        ("tests/test_rows.py",),
    ),
    # --- shares / shuffling ----------------------------------------------
    launched(
        "shares-padding-trains",
        "epochs",
        "the padding of the last global batch trains, as before",
        "accel_mixin/training/epochs.py",
        "            elif not real or criterion_is_mean(self.net.criterion_):\n",
        "            elif False:  # pylint: disable=using-constant-test\n",
        ("tests/test_shares.py",),
    ),
    launched(
        "shares-unweighted",
        "stepping",
        "each rank trains on its real samples, without its share as the weight",
        "accel_mixin/net/steps.py",
        "        return scale_gradient(loss, self._stepper.loss_weight) if training else loss\n",
        "        return loss\n",
        ("tests/test_shares.py",),
    ),
    launched(
        "shuffling-seeded-once",
        "wrapping",
        "accelerate's sampler generator keeps the seed it drew at prepare",
        "accel_mixin/training/wrapping.py",
        "            draw_orders_as_one_process(prepared)\n",
        "            pass\n",
        ("tests/test_shares.py",),
    ),
    launched(
        "shuffling-prepare-draws",
        "wrapping",
        "the seed accelerate draws at prepare stays drawn from the global generator",
        "accel_mixin/training/wrapping.py",
        "    with keeping_global_draws(own_generator):\n",
        "    with keeping_global_draws(False):\n",
        ("tests/test_shares.py",),
    ),
    Break(
        "shares-padding-is-real",
        "shares",
        "count the padding of the last step as real samples",
        "accel_mixin/training/shares.py",
        "    return min(max(remainder - process_index * batch_size, 0), batch_size)",
        "    return batch_size",
        ("tests/test_share_weights.py",),
    ),
    Break(
        "shares-weight-of-whole-batches",
        "shares",
        "the weight counts the padding as real",
        "accel_mixin/training/shares.py",
        "    return 1.0 if remainder is None else real * num_processes / remainder\n",
        "    return 1.0\n",
        ("tests/test_share_weights.py",),
    ),
    # --- sharding (FSDP2) ------------------------------------------------
    launched(
        "sharding-prepared-apart",
        "wrapping",
        "under FSDP2 the module and its optimizer are prepared each on its own",
        "accel_mixin/training/wrapping.py",
        "        if sharded(accelerator):\n            self._prepare_sharded(accelerator, slots)\n",
        "",
        (FSDP + "test_fsdp2_trains_as_ddp_and_as_one_process_with_n_times_the_batch[2-processes]",),
    ),
    launched(
        "sharding-files-hold-local-shards",
        "checkpointing",
        "save_params writes each module's local state (its shards) instead of the gathered one",
        "accel_mixin/net/saving.py",
        "        if not sharded(self.accelerator):\n            return {}\n",
        "        if True:\n            return {}\n",
        (FSDP + "test_save_params_writes_full_files_that_plain_skorch_loads[2-processes]",),
    ),
    launched(
        "sharding-optimizer-file-by-name",
        "sharding",
        "the optimizer file keeps torch's parameter names instead of positions",
        "accel_mixin/distributed/sharding.py",
        "            state = optimizer_state_by_position(state) if state else state\n",
        "",
        (FSDP + "test_full_files_load_into_a_sharded_net_with_the_optimizer_state[2-processes]",),
    ),
    launched(
        "sharding-load-keeps-full-tensors",
        "sharding",
        "a full file is loaded into a sharded module without cutting this rank's shards",
        "accel_mixin/distributed/sharding.py",
        "if is_sharded(expected.get(key)) else value)",
        "if False else value)",
        (FSDP + "test_full_files_load_into_a_sharded_net_with_the_optimizer_state[2-processes]",),
    ),
    launched(
        "sharding-optimizer-load-keeps-full-tensors",
        "sharding",
        "a full optimizer file is loaded without cutting this rank's shards",
        "accel_mixin/distributed/sharding.py",
        "    if not any(is_sharded(p) for p in params):\n        return state\n",
        "    return state\n",
        (FSDP + "test_full_files_load_into_a_sharded_net_with_the_optimizer_state[2-processes]",),
    ),
    launched(
        "sharding-second-module-trains-unsynced",
        "sharding",
        "a second module with parameters is not refused under FSDP2",
        "accel_mixin/distributed/sharding.py",
        "            if count:\n                raise ValueError(",
        "            if False:\n                raise ValueError(",
        (FSDP + "test_what_fsdp2_cannot_do_is_refused_naming_it[2-processes-second_module]",),
    ),
    launched(
        "sharding-shards-compared-as-replicas",
        "replicas",
        "the replica check compares the ranks' shards as if they were replicas",
        "accel_mixin/distributed/sharding.py",
        "    return [(name, param) for name, param in named_params if not is_sharded(param)]",
        "    return list(named_params)",
        (FSDP + "test_fsdp2_trains_as_ddp_and_as_one_process_with_n_times_the_batch[2-processes]",),
    ),
    launched(
        "sharding-low-precision-outputs",
        "stepping",
        "under FSDP2 with bf16 the module's bf16 outputs reach skorch's scorers",
        "accel_mixin/training/stepping.py",
        '        self.fp32_outputs = sharded(accelerator) and accelerator.mixed_precision != "no"',
        "        self.fp32_outputs = False",
        (FSDP + "test_mixed_precision_is_fsdps_policy_with_float32_predictions[2-processes]",),
    ),
    launched(
        "sharding-accumulate-unsharded-modules",
        "stepping",
        "accumulation asks the criterion, which FSDP2 does not shard, to hold back its sync",
        "accel_mixin/training/stepping.py",
        '            modules = [m for m in modules if hasattr(m, "set_requires_gradient_sync")]\n',
        "            pass\n",
        (FSDP + "test_gradient_clipping_is_global_and_accumulation_works[2-processes]",),
    ),
    launched(
        "sharding-gathered-parameters-taken",
        "net_objects",
        "a new optimizer and callbacks take the root's gathered parameters, not its shards",
        "accel_mixin/training/net_objects.py",
        "        if named is not None:\n            reshard(named[1])\n",
        "        pass\n",
        (FSDP + "test_freezer_and_a_new_optimizer_train_as_under_ddp[2-processes]",),
    ),
    launched(
        "sharding-new-optimizer-prepared-with-the-module",
        "wrapping",
        "a new optimizer of a sharded module is prepared again with the module, whose empty "
        "shards accelerate matches by address",
        "accel_mixin/training/wrapping.py",
        "        if self._holds(slot):\n            # a new optimizer of the sharded module",
        "        if False:\n            # a new optimizer of the sharded module",
        (FSDP + "test_freezer_and_a_new_optimizer_train_as_under_ddp[3-processes]",),
    ),
    launched(
        "sharding-fsdp1-accepted",
        "process_layout",
        "FSDP1 is not refused",
        "accel_mixin/distributed/process_layout.py",
        "    if kind == DistributedType.FSDP and not sharded(accelerator):",
        "    if False:",
        (FSDP + "test_what_fsdp2_cannot_do_is_refused_naming_it[2-processes-fsdp1]",),
    ),
    launched(
        "replicas-counts-not-compared",
        "replicas",
        "the parameter counts are not compared: other models are compared by position",
        "accel_mixin/distributed/replicas.py",
        "    if any(count != counts[0] for count in counts):\n",
        "    if False:\n",
        (
            "tests/test_divergence.py::"
            "test_ranks_that_built_other_models_are_named_with_their_parameter_counts",
        ),
    ),
    # --- sharded training states --------------------------------------------
    launched(
        "v1_shards-module-shards-not-loaded",
        "load",
        "load_state leaves the sharded module's weights of an earlier release's state as they were",
        "accel_mixin/resume/load.py",
        '            load_sharded_module(module, source, saved[name], name + "_")\n',
        "            pass\n",
        (OLD_FORMAT_FSDP,),
    ),
    launched(
        "v1_shards-optimizer-not-loaded",
        "load",
        "load_state leaves the sharded optimizer's state of an earlier release's state as it was",
        "accel_mixin/resume/load.py",
        "            load_sharded_optimizer(\n",
        "            (lambda *args: None)(\n",
        (OLD_FORMAT_FSDP,),
    ),
    launched(
        "v1_shards-hyperparameters-lost",
        "v1_shards",
        "the optimizer's groups keep what torch's loader keeps (a scheduler's initial_lr lost)",
        "accel_mixin/checkpoint/v1_shards.py",
        '        group.update((key, value) for key, value in saved.items() if key != "params")\n',
        "        pass\n",
        (FSDP_STATE + "test_a_save_failing_after_the_shards_leaves_the_previous_state",),
    ),
    launched(
        "v1_shards-best-weights-not-loaded",
        "load",
        "EarlyStopping's best weights in the folder of shards are not read back",
        "accel_mixin/resume/load.py",
        "        if isinstance(entry, InFolder):\n            module = _module_of(",
        "        if False:\n            module = _module_of(",
        (FSDP_STATE + "test_early_stoppings_best_weights_other_than_the_current_come_back",),
    ),
    launched(
        "v1_shards-rotation-keeps-folders",
        "callbacks",
        "rotation deletes old files but not their folders of shards",
        "accel_mixin/callbacks.py",
        "                remove_training_state(path)\n",
        "                os.unlink(path)\n",
        (FSDP_STATE + "test_rotation_removes_folders_and_leaves_nothing_partial",),
    ),
    Break(
        "v1_shards-dcp-error-raw",
        "v1_shards",
        "DCP's CheckpointException (a BaseException) passes through instead of naming the file",
        "accel_mixin/checkpoint/v1_shards.py",
        "    except checkpoint_exception() as exc:  # on every rank, with every rank's failure\n",
        "    except Exception as exc:  # on every rank, with every rank's failure\n",
        ("tests/test_v1_shards.py",),
    ),
    # --- issue 46: augmenting data ---------------------------------------------
    Break(
        "sample-rows-generators-not-found",
        "sample_rows",
        "the generators a Dataset holds (in transforms, closures, partials) are not found, so "
        "rows are read with each rank's own seeds of them",
        "accel_mixin/distributed/sample_rows.py",
        "    return list(found.values())\n",
        "    return []\n",
        ("tests/test_sample_rows.py", "tests/test_runs.py", "-m", "not multiprocess"),
    ),
    Break(
        "sample-rows-read-once",
        "sample_rows",
        "rows are read once: rows drawn from the OS's entropy are compared and hashed, so "
        "the ranks never agree and the run identity differs at every fit",
        "accel_mixin/distributed/sample_rows.py",
        "    return digests[0] if digests[0] == digests[1] else None\n",
        "    return digests[0]\n",
        ("tests/test_sample_rows.py",),
    ),
    launched(
        "replicas-rows-read-by-chance",
        "replicas",
        "the replica check reads rows with each rank's random state: an augmenting Dataset "
        "cannot train on 2 processes",
        "accel_mixin/distributed/replicas.py",
        "        digest = repeatable_digest((X, y), read, _hashed)\n",
        "        digest = _hashed(read())\n",
        (
            "tests/test_sample_rows.py",
            "tests/test_runs.py::test_a_dataset_that_augments_at_random_resumes_exactly",
        ),
    ),
    # --- issue 46: settings honoured or refused ----------------------------------
    launched(
        "layout-fsdp-asked-not-selected-trains-ddp",
        "process_layout",
        "FSDP asked for (plugin or ACCELERATE_USE_FSDP) on CPU trains unsharded DDP silently",
        "accel_mixin/distributed/process_layout.py",
        '    if kind == DistributedType.FSDP or not parse_flag_from_env("ACCELERATE_USE_FSDP"):\n',
        "    if True:\n",
        (
            "tests/test_mixin.py::test_fsdp_asked_for_in_one_process_on_cpu_is_refused",
            FSDP + "test_fsdp_asked_for_on_cpu_is_refused_naming_why",
        ),
    ),
    Break(
        "net-device-checked-after-skorch-moves",
        "net",
        "device is checked after skorch's initialize moved the module: device='cuda' without "
        "CUDA fails in torch",
        "accel_mixin/net/mixin.py",
        "        check_device(self)  # skorch's initialize moves the module first\n",
        "",
        ("tests/test_mixin.py", "-k", "device"),
    ),
    # --- issue 46: resumes say what they did ------------------------------------
    launched(
        "resume-says-nothing-on-resume",
        "callbacks",
        "a resume prints no line naming its file and where it continues",
        "accel_mixin/callbacks.py",
        '                self.sink(f"ResumeTraining: {what} from {path} (after {where})")\n',
        "                pass\n",
        (RESUME + "test_a_resume_names_the_file_and_where_it_continues",),
    ),
    launched(
        "resume-ignores-states-outside-run-folders",
        "callbacks",
        "a fresh start next to training states outside run folders says nothing of them",
        "accel_mixin/callbacks.py",
        "    loose = checkpoint_files(dirname)\n",
        "    loose = []\n",
        (RESUME + "test_a_fresh_start_next_to_other_runs_states_says_so",),
    ),
    launched(
        "resume-misspelt-folder-silent",
        "callbacks",
        "ResumeTraining in another folder than TrainingCheckpoint's warns nothing",
        "accel_mixin/callbacks.py",
        "        if written and _same_folder(self.dirname) not in "
        "{_same_folder(d) for d in written}:\n",
        "        if False:\n",
        (RESUME + "test_a_resume_folder_that_no_checkpoint_writes_to_warns",),
    ),
    launched(
        "resume-without-checkpoint-silent",
        "callbacks",
        "ResumeTraining without TrainingCheckpoint and nothing to resume warns nothing",
        "accel_mixin/callbacks.py",
        "        if net.accelerator.is_main_process and not self._writers(net):\n",
        "        if False:\n",
        (RESUME + "test_a_resume_folder_that_no_checkpoint_writes_to_warns",),
    ),
    Break(
        "resume-folders-compared-as-strings",
        "callbacks",
        "one folder spelt two ways ('ckpt/', './ckpt') warns as two folders",
        "accel_mixin/callbacks.py",
        "    return os.path.normcase(os.path.realpath(os.fspath(dirname)))\n",
        "    return os.fspath(dirname)\n",
        ("tests/test_runs.py::test_one_folder_spelt_two_ways_is_one_folder",),
    ),
    launched(
        "resume-says-it-on-every-rank",
        "callbacks",
        "ResumeTraining's lines go to the sink of every rank, not the main process's only",
        "accel_mixin/callbacks.py",
        "        return net.verbose and net.accelerator.is_main_process\n",
        "        return net.verbose\n",
        (RESUME + "test_nothing_is_said_on_other_ranks",),
    ),
    launched(
        "resume-says-it-at-verbose-0",
        "callbacks",
        "ResumeTraining's lines are printed with verbose=0",
        "accel_mixin/callbacks.py",
        "        return net.verbose and net.accelerator.is_main_process\n",
        "        return net.accelerator.is_main_process\n",
        (RESUME + "test_a_resume_names_the_file_and_where_it_continues",),
    ),
    # --- issue 46: the transformer example resumes ---
    launched(
        "transformer-example-tokenizer-trained-every-launch",
        "examples",
        "every launch trains a new tokenizer instead of loading the saved one",
        "examples/transformer.py",
        '    path = os.path.join(dirname, "tokenizer")\n',
        '    path = os.path.join(dirname, "tokenizer")\n'
        "    if accelerator.is_main_process:\n"
        "        shutil.rmtree(path, ignore_errors=True)\n",
        (EXAMPLES + "test_transformer_example_preempted_and_rerun_ends_as_an_uninterrupted_run",),
    ),
    launched(
        "transformer-example-search-swallows-preempted",
        "examples",
        "the search keeps scikit-learn's error_score (nan): Preempted is a failed fit",
        "examples/transformer.py",
        '        error_score="raise",\n',
        "",
        (EXAMPLES + "test_transformer_example_preempted_and_rerun_ends_as_an_uninterrupted_run",),
    ),
    launched(
        "faq-tokenizer-trained-on-every-rank",
        "docs",
        "the FAQ's recipe trains a tokenizer on every rank and shares none",
        "docs/guide/faq.md",
        "trained = [tokenizer.fit(X).fast_tokenizer_ if accelerator.is_main_process else None]\n"
        "broadcast_object_list(trained)",
        "trained = [tokenizer.fit(X).fast_tokenizer_]",
        (EXAMPLES + "test_the_faqs_recipe_gives_every_rank_the_tokenizer_of_the_main_process",),
    ),
    # --- issue 46: FSDP2 training states under faults ----------------------
    launched(
        "sharded_faults-save-outcome-not-gathered",
        "state_saves",
        "a failed save raises on each rank what that rank saw, not one error naming every rank's",
        "accel_mixin/checkpoint/state_saves.py",
        "        items = sorted(exc.failures.items())\n",
        "        items = [item for item in exc.failures.items() if item[0] == rank]\n",
        (FAULTS + "test_a_write_failing_on_one_rank_raises_one_error_on_every_rank",),
    ),
    launched(
        "sharded_faults-damage-taken-for-other-parameters",
        "v1_shards",
        "a deleted, truncated or corrupted shard is reported as a net of other parameters",
        "accel_mixin/checkpoint/v1_shards.py",
        "        if is_damage(exc):\n",
        "        if False:\n",
        (FAULTS + "test_a_damaged_shard_is_named_with_the_newest_intact_state",),
    ),
    launched(
        "sharded_faults-intact-unchecked",
        "shard_damage",
        "the state named as intact beside a damaged one is any older file, damaged or not",
        "accel_mixin/checkpoint/shard_damage.py",
        "            if os.path.abspath(path) != source and intact(path):\n",
        "            if os.path.abspath(path) != source:\n",
        (FAULTS + "test_where_no_state_beside_it_is_intact_none_is_named",),
    ),
    Break(
        "folder_claim-no-lock",
        "folder_claim",
        "a run folder's claim takes no lock: a second live job writes there too",
        "accel_mixin/checkpoint/folder_claim.py",
        "            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "            pass\n",
        (FAULTS + "test_a_claim_ends_with_its_process_however_it_ends",),
    ),
    launched(
        "folder_claim-refused-on-main-only",
        "callbacks",
        "a second job is refused on its main process only; the other ranks learn it second-hand",
        "accel_mixin/callbacks.py",
        "            holder = next(filter(None, gather_object([holder])), None)\n",
        "            pass\n",
        (FAULTS + "test_a_second_job_writing_the_run_folder_is_refused_naming_the_first",),
    ),
    launched(
        "checkpointing-in-flight-label-always",
        "checkpointing",
        "a load's failure is labelled a wait for asynchronous saves even with none in flight",
        "accel_mixin/net/saving.py",
        "        waits = self._local.saves.in_flight is not None\n",
        "        waits = True\n",
        ("tests/test_liveness.py::test_the_surviving_machine_raises_naming_the_rank_that_is_gone",),
    ),
    Break(
        "atomic_files-temporary-named",
        "atomic_files",
        "a failed write's message names the temporary file written in the target's place",
        "accel_mixin/checkpoint/atomic_files.py",
        '        f"({without_name(exc)})",\n',
        '        f"({type(exc).__name__}: {exc})",\n',
        ("tests/test_params.py::test_a_read_only_filesystem_is_named",),
    ),
    # --- issue 46: FSDP2 memory on CPU ---
    launched(
        "sharding-replaced-module-kept",
        "wrapping",
        "a sharded module replaced by a new fit stays, with its shards, until a full collection",
        "accel_mixin/training/wrapping.py",
        "        if replaced:\n            # a sharded module",
        "        if False:\n            # a sharded module",
        (FSDP + "test_refitting_frees_the_replaced_module_at_once[2-processes]",),
    ),
    # --- issue 47: no process-global state ---
    Break(
        "wrapping-plateau-left-as-accelerate-built-it",
        "wrapping",
        "a ReduceLROnPlateau keeps accelerate's wrapper: skorch steps it without the score",
        "accel_mixin/training/wrapping.py",
        "        prepared = _as_plateau(accelerator, prepared)\n",
        "        pass\n",
        ("tests/test_wrapping.py::test_plateau_scheduler_still_passes_for_one",),
    ),
    Break(
        "stepping-scaler-update-not-held-back",
        "stepping",
        "several optimizers under a scaler: each optimizer's step updates the scaler",
        "accel_mixin/training/stepping.py",
        "            optimizer.scaler = deferred\n",
        "            pass\n",
        ("tests/test_stepping.py::test_several_optimizers_update_the_scaler_once",),
    ),
    # --- issue 47: scores recorded and workers refused without process-global state ---
    launched(
        "epoch_scores-recorded-through-the-class",
        "epoch_scores",
        "the main process's score reaches a scorer through EpochScoring._scoring, left replaced",
        "accel_mixin/distributed/epoch_scores.py",
        "            record_score(cb, net.history, score)\n",
        "            EpochScoring._scoring = lambda *_, score=score: score\n"
        "            record_score(cb, net.history, score)\n",
        (
            SCORES + "test_scores_recorded_at_their_turn_leave_the_callbacks_and_their_class_alone",
            SCORES + "test_recorded_scores_leave_the_callbacks_and_their_class_alone",
        ),
    ),
    launched(
        "epoch_scores-score-left-on-the-scorer",
        "epoch_scores",
        "the main process's score is left on the scorer, which Checkpoint's f_pickle carries",
        "accel_mixin/distributed/epoch_scores.py",
        "            record_score(cb, net.history, score)\n",
        "            record_score(cb, net.history, score)\n            cb.replayed_ = score\n",
        (
            SCORES + "test_scores_recorded_at_their_turn_leave_the_callbacks_and_their_class_alone",
            SCORES + "test_recorded_scores_leave_the_callbacks_and_their_class_alone",
        ),
    ),
    Break(
        "epoch_scores-scored-again-at-its-turn",
        "epoch_scores",
        "a scorer scored on the main process scores again on every rank at its turn",
        "accel_mixin/distributed/epoch_scores.py",
        "        if name not in outcomes:\n",
        "        if True:\n",
        (SCORES + "test_scores_recorded_at_their_turn_leave_the_callbacks_and_their_class_alone",),
    ),
    launched(
        "process_layout-child-of-a-rank-not-refused",
        "process_layout",
        "a worker started by a torchrun rank is not refused, and waits for a rendezvous",
        "accel_mixin/distributed/process_layout.py",
        "    if started is None or any(",
        "    if True or any(",
        (
            "tests/test_process_layout.py::test_a_child_of_a_launched_rank_is_refused_naming_it",
            "tests/test_process_layout.py::test_worker_processes_of_a_rank_get_a_clear_error",
        ),
    ),
    launched(
        "process_layout-every-child-with-the-variables-refused",
        "process_layout",
        "any process with WORLD_SIZE > 1 whose parent is readable is refused: "
        "notebook_launcher's ranks too",
        "accel_mixin/distributed/process_layout.py",
        "    if started is None or any(",
        "    if started is None or False and any(",
        (
            "tests/test_process_layout.py::test_a_rank_whose_launcher_lacks_its_variables_is_not_refused",
            "tests/test_process_layout.py::test_ranks_forked_by_notebook_launcher_are_not_refused",
        ),
    ),
    # --- issue 47: control plane ---
    Break(
        "control-port-one-reading",
        "control",
        "gloo's byte-swapped port is read as it is printed: a dead peer goes unnamed",
        "accel_mixin/distributed/control.py",
        '    return {port, struct.unpack("<H", struct.pack(">H", port))[0]}',
        "    return {port}",
        (COORDINATION + "test_a_closed_connection_names_the_rank_whose_socket_it_was",),
    ),
    Break(
        "control-address-table-empty",
        "control",
        "the peers' sockets are gathered but not kept: a closed connection names no rank",
        "accel_mixin/distributed/control.py",
        "                    self._peers[(address, int(port))] = rank",
        "                    pass",
        (COORDINATION + "test_a_closed_connection_names_the_rank_whose_socket_it_was",),
    ),
    Break(
        "control-agreed-failure-not-kept",
        "control",
        "a failure learned deeper than the failing section is forgotten: barrier counts part",
        "accel_mixin/distributed/control.py",
        "            entry[2] = message",
        "            pass",
        (COORDINATION + "test_a_callback_error_meets_a_save_that_another_rank_swallows",),
    ),
    Break(
        "control-swallowed-failure-not-carried",
        "control",
        "a failure learned in an inner section leaves the outer one without a barrier, "
        "while a rank that swallowed it waits there",
        "accel_mixin/distributed/control.py",
        "                or any(entry[2] is not None for entry in control._open)\n",
        "                or any(entry[2] is not None for entry in control._open)\n"
        "                or agreed_failure(exc)\n"
        "                or exc is control._carried[0]\n",
        (
            COORDINATION
            + "test_a_failure_swallowed_on_one_rank_only_reaches_it_at_its_next_barrier",
        ),
    ),
    Break(
        "control-carried-failure-renamed",
        "control",
        "a rank's failure, carried out of an outer section, is named after that section",
        "accel_mixin/distributed/control.py",
        "                priority, message = _ECHO, carried_message\n",
        "                priority = _OWN\n"
        "                message = failure_message(self.what, control.process_index, exc)\n",
        (
            COORDINATION
            + "test_a_failure_swallowed_on_one_rank_only_reaches_it_at_its_next_barrier",
        ),
    ),
    Break(
        "control-run-no-final-barrier",
        "control",
        "remove the barrier that ends run(): ranks return before the write ends",
        "accel_mixin/distributed/control.py",
        "            self.barrier(what, _WRITER_CAP.total_seconds())\n",
        "",
        (COORDINATION + "test_a_run_without_progress_fails_on_every_rank_after_its_io_timeout",),
    ),
    Break(
        "control-run-waiters-own-timeout",
        "control",
        "the ranks waiting for run()'s writer give up after their timeout while it writes",
        "accel_mixin/distributed/control.py",
        "            self.barrier(what, _WRITER_CAP.total_seconds())\n",
        "            self.barrier(what)\n",
        (COORDINATION + "test_a_run_slower_than_the_timeout_succeeds_while_it_writes",),
    ),
    Break(
        "control-failure-ignored",
        "control",
        "a waiting rank passes a barrier in which another rank reported its failure",
        "accel_mixin/distributed/control.py",
        "        if outcome is not None and failure is None:\n            raise outcome",
        "        if False:\n            raise outcome",
        (COORDINATION + "test_an_error_on_one_rank_reaches_the_other_promptly",),
    ),
    Break(
        "control-quiet-rank-is-gone",
        "control",
        "a live rank that does not arrive within the timeout is called gone",
        "accel_mixin/distributed/control.py",
        "        return lambda later: self._timed_out(later, wait, missing)",
        "        return functools.partial(self._gone, rank=missing[0])",
        (COORDINATION + "test_a_live_rank_that_does_not_arrive_is_named_not_gone",),
    ),
    launched(
        "control-writer-gone-unnamed",
        "control",
        "a rank waiting for the writer's outcome does not name the writer whose process ended",
        "accel_mixin/distributed/control.py",
        "            raise self._failed(what, exc, _WRITER_CAP, [writer]) from exc\n",
        "            raise self._break(\n"
        "                lambda later: self._timed_out(later, _WRITER_CAP, [writer]), what\n"
        "            ) from exc\n",
        (
            "tests/test_liveness.py::"
            "test_among_four_processes_every_other_rank_names_the_one_missing[writer-ended]",
        ),
    ),
    Break(
        "control-writer-failure-not-told",
        "control",
        "a writer whose write failed tells the others it succeeded",
        "accel_mixin/distributed/control.py",
        "            self._tell(message)\n",
        '            self._tell("")\n',
        (
            COORDINATION + "test_main_only_failure_reaches_the_others",
            COORDINATION + "test_a_run_without_progress_fails_on_every_rank_after_its_io_timeout",
        ),
    ),
    Break(
        "control-writer-waits-a-timeout",
        "control",
        "the ranks waiting for the writer's outcome give up after their timeout while it writes",
        "accel_mixin/distributed/control.py",
        "_TOLD).wait(_WRITER_CAP)",
        "_TOLD).wait(timedelta(seconds=self.timeout))",
        (COORDINATION + "test_a_run_slower_than_the_timeout_succeeds_while_it_writes",),
    ),
    launched(
        "control-attempts-share-the-group",
        "control",
        "a restarted attempt makes its group on the keys the dead attempt left in a kept store",
        "accel_mixin/distributed/control.py",
        '    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")',
        '    attempt = "0"',
        (
            COORDINATION + "test_a_restarted_attempt_never_meets_the_dead_one",
            "tests/test_liveness.py::"
            "test_on_a_store_shared_across_restarts_no_key_of_the_dead_attempt_is_read",
        ),
    ),
    launched(
        "control-transport-error-raw",
        "control",
        "gloo's error as a peer ends, leaving a section, is raised as it is, naming no rank",
        "accel_mixin/distributed/control.py",
        "            lost = control._lost(self.what, exc) if isinstance(exc, RuntimeError) "
        "else None\n",
        "            lost = None\n",
        ("tests/test_liveness.py::test_a_rank_that_ends_in_any_phase_is_named_on_two_machines",),
    ),
    Break(
        "io_watchdog-stall-never-fails",
        "io_watchdog",
        "a file operation without progress waits forever",
        "accel_mixin/distributed/io_watchdog.py",
        "            elif time.monotonic() - last_progress > io_timeout:",
        "            elif False:",
        (COORDINATION + "test_a_run_without_progress_fails_on_every_rank_after_its_io_timeout",),
    ),
    Break(
        "io_watchdog-alive-is-progress",
        "io_watchdog",
        "a live worker thread counts as progress, as a heartbeat would",
        "accel_mixin/distributed/io_watchdog.py",
        "            if self._sampler.advanced():\n",
        "            if True:\n",
        (COORDINATION + "test_a_run_without_progress_fails_on_every_rank_after_its_io_timeout",),
    ),
    Break(
        "io_watchdog-stalled-worker-kept",
        "io_watchdog",
        "after a stall the next file operation queues behind the stuck one on the same worker",
        "accel_mixin/distributed/io_watchdog.py",
        "        self._jobs = self._worker = None\n",
        "",
        (COORDINATION + "test_a_writer_is_kept_between_runs_and_replaced_after_a_stall",),
    ),
    Break(
        "io_watchdog-worker-holds-last-save",
        "io_watchdog",
        "the waiting writer thread holds the last save's function, and with it its net",
        "accel_mixin/distributed/io_watchdog.py",
        "                del job  # waiting for the next, hold nothing of this one (its net)\n",
        "",
        (
            COORDINATION + "test_a_writer_is_kept_between_runs_and_replaced_after_a_stall",
            "tests/test_multiprocess.py::test_lists_do_not_grow_and_nothing_is_prepared_twice",
        ),
    ),
    Break(
        "control-outcomes-not-combined",
        "control",
        "a barrier keeps this rank's own outcome, not every rank's maximum",
        "accel_mixin/distributed/control.py",
        "            numpy.maximum(table[0], table[1], out=table[0])",
        "            pass",
        (COORDINATION + "test_an_error_on_one_rank_reaches_the_other_promptly",),
    ),
    Break(
        "control-closed-peer-not-passed-on",
        "control",
        "a rank that finds a peer's connection closed keeps it to itself: the others time out",
        "accel_mixin/distributed/control.py",
        "                table[0, -1] = max(int(table[0, -1]), *(2 + peer for peer in closed))",
        "                pass",
        (COORDINATION + "test_among_four_ranks_a_rank_that_ends_is_named_at_once_by_every_other",),
    ),
    Break(
        "control-send-dropped-after-failed-receive",
        "control",
        "a round whose receive found a closed connection drops its send, so its target waits",
        "accel_mixin/distributed/control.py",
        "            closed.append(peer)\n    for peer, work in works:",
        "            closed.append(peer)\n            return closed\n    for peer, work in works:",
        (COORDINATION + "test_among_four_ranks_a_rank_that_ends_is_named_at_once_by_every_other",),
    ),
    Break(
        "control-census-does-not-wait",
        "control",
        "the census reads who arrived before the ranks that arrived later have said so",
        "accel_mixin/distributed/control.py",
        '            store.wait(["all"], wait)',
        "            pass",
        (
            COORDINATION
            + "test_among_four_ranks_a_rank_that_does_not_arrive_is_named_by_every_other",
        ),
    ),
    # --- issue 47: the epoch's collectives ---
    Break(
        "object_gather-room-not-grown",
        "object_gather",
        "a gather's room stays at its first size: every larger payload takes two collectives",
        "accel_mixin/distributed/object_gather.py",
        "            self._rooms[site] = 1 << (largest - 1).bit_length()\n",
        "            pass\n",
        (
            COORDINATION
            + "test_a_gather_gives_every_rank_s_object_in_one_all_gather_once_its_room_is_known",
        ),
    ),
    Break(
        "object_gather-remainder-dropped",
        "object_gather",
        "a payload past the room is cut at the room",
        "accel_mixin/distributed/object_gather.py",
        "        if largest > room:\n",
        "        if False:\n",
        (
            COORDINATION
            + "test_a_gather_gives_every_rank_s_object_in_one_all_gather_once_its_room_is_known",
        ),
    ),
    Break(
        "control-flag-not-agreed",
        "control",
        "a barrier returns this rank's own flag, not the largest of every rank's",
        "accel_mixin/distributed/control.py",
        "        flag = outcome[4]\n",
        "        flag = max(0, flag)\n",
        (COORDINATION + "test_a_barrier_gives_every_rank_the_largest_flag_any_rank_gave",),
    ),
    launched(
        "mixin-retrainable-not-asked",
        "mixin",
        "no rank says at the epoch's begin that its trainable parameters changed",
        "accel_mixin/net/mixin.py",
        "                notification.flag = bool(retrainable_modules(self._objects))\n",
        "                notification.flag = 0\n",
        (DIV + "test_freezer_after_prepare_trains_one_model",),
    ),
    # --- issue 47: one checkpoint format ---
    Break(
        "dcp-folder-plain-values-unsafe",
        "dcp_folder",
        "a training state's plain values load with weights_only=False, running pickled code",
        "accel_mixin/checkpoint/dcp_folder.py",
        '            {"weights_only": True} if torch_load_kwargs is None',
        '            {"weights_only": False} if torch_load_kwargs is None',
        ("tests/test_dcp_folder.py::test_plain_values_that_would_run_code_are_refused",),
    ),
    Break(
        "dcp-folder-metadata-unrestricted",
        "dcp_folder",
        "DCP's .metadata is unpickled without restriction, running pickled code",
        "accel_mixin/checkpoint/dcp_folder.py",
        "            metadata = _MetadataUnpickler(file).load()\n",
        "            metadata = pickle.load(file)\n",
        ("tests/test_dcp_folder.py::test_a_metadata_file_that_would_run_code_is_refused",),
    ),
    Break(
        "dcp-folder-commit-in-place",
        "dcp_folder",
        "a replaced state is removed before the new one is renamed into place",
        "accel_mixin/checkpoint/dcp_folder.py",
        "        os.rename(path, aside)\n",
        "        _remove(path)\n",
        ("tests/test_dcp_folder.py::test_a_commit_that_fails_leaves_the_previous_state",),
    ),
    Break(
        "dcp-folder-async-commit-late",
        "dcp_folder",
        "an asynchronous save's future ends before its folder is committed",
        "accel_mixin/checkpoint/dcp_folder.py",
        "    future.add_done_callback(done)\n    return committed\n",
        "    future.add_done_callback(done)\n    return future\n",
        ("tests/test_dcp_folder.py::test_an_asynchronous_save_commits_when_its_future_ends",),
    ),
    launched(
        "dcp-folder-each-rank-alone",
        "dcp_folder",
        "each rank saves as if it were alone, over the others' files",
        "accel_mixin/checkpoint/dcp_folder.py",
        "    no_dist = not _distributed() or (alone and group is None)\n",
        "    no_dist = True\n",
        (
            "tests/test_dcp_folder.py::"
            "test_two_processes_save_one_folder_that_loads_on_each_and_on_one",
        ),
    ),
    Break(
        "state-folder-optimizer-by-position",
        "state_folder",
        "an optimizer's state is saved keyed by parameter positions, which fit one layout only",
        "accel_mixin/resume/state_folder.py",
        "    if owner is None:\n        return plain(optimizer.state_dict())\n",
        "    if True:\n        return plain(optimizer.state_dict())\n",
        (
            "tests/test_state_folder.py::"
            "test_a_folder_holds_the_single_file_state_under_parameter_names",
        ),
    ),
    Break(
        "state-saves-partial-left",
        "state_saves",
        "a failed save leaves its partial folder beside the states",
        "accel_mixin/checkpoint/state_saves.py",
        "    if alone or rank == 0:\n        remove_partial_folders(directory, name)\n",
        "    if False:\n        remove_partial_folders(directory, name)\n",
        (
            "tests/test_state_folder.py::"
            "test_a_failed_save_names_the_state_and_leaves_the_previous_one",
        ),
    ),
    Break(
        "state-folder-optimizer-misplaced",
        "state_folder",
        "an optimizer state read from a folder puts each parameter's moments at another's place",
        "accel_mixin/resume/state_folder.py",
        '            position[name]: value for name, value in optimizer_state.get("state", {})',
        "            len(position) - 1 - position[name]: value\n"
        '            for name, value in optimizer_state.get("state", {})',
        (
            "tests/test_state_folder.py::"
            "test_load_state_resumes_from_a_folder_as_from_the_single_file",
        ),
    ),
    launched(
        "state-folder-one-rng-key",
        "state_folder",
        "every rank saves its generators under rank 0's key, over each other's",
        "accel_mixin/resume/state_folder.py",
        '    entries = {rank_key("rng", rank): plain(rng_state())}\n',
        '    entries = {rank_key("rng", 0): plain(rng_state())}\n',
        (
            "tests/test_state_folder.py::"
            "test_on_two_processes_each_rank_writes_its_part_of_one_folder",
        ),
    ),
    launched(
        "state-folder-groups-not-restored",
        "load",
        "a sharded net's optimizers lose the hyperparameters schedulers add (initial_lr)",
        "accel_mixin/resume/load.py",
        "    restore_groups(optimizer, groups)\n    return {",
        "    return {",
        (FSDP_STATE + "test_a_save_failing_after_the_shards_leaves_the_previous_state",),
    ),
    launched(
        "positions-folders-not-found",
        "positions",
        "ResumeTraining finds old .pt files only, never a state folder",
        "accel_mixin/checkpoint/positions.py",
        "        elif is_file != os.path.isfile(path) or",
        "        elif not is_file or",
        ("tests/test_resume.py::test_resumed_run_repeats_the_uninterrupted_one_bit_for_bit",),
    ),
    launched(
        "state-saves-missing-directory-created",
        "state_saves",
        "a save into a directory that vanished recreates it (DCP's) instead of raising",
        "accel_mixin/checkpoint/state_saves.py",
        "    check_directory(path)\n",
        "",
        ("tests/test_resume.py::test_a_failed_asynchronous_write_raises_on_every_rank",),
    ),
    launched(
        "load-damaged-folder-raw",
        "load",
        "a damaged state folder raises DCP's CheckpointException, naming nothing to do",
        "accel_mixin/resume/load.py",
        "        raise CheckpointError(damaged_message(path, path, failures(exc))) from None\n",
        "        raise\n",
        (FAULTS + "test_a_damaged_shard_is_named_with_the_newest_intact_state",),
    ),
    launched(
        "v1_shards-rotation-folder-kept",
        "v1_shards",
        "rotation leaves the folders of the states it removes",
        "accel_mixin/checkpoint/v1_shards.py",
        "            os.rename(path, aside)\n",
        "            pass\n",
        (FSDP_STATE + "test_rotation_removes_folders_and_leaves_nothing_partial",),
    ),
    launched(
        "state-folder-module-not-loaded",
        "load",
        "a sharded net's load_state leaves its module's weights as they were",
        "accel_mixin/resume/load.py",
        '            load_module_from(module, source, saved[name].keys, source, name + "_")\n',
        "            pass\n",
        (
            FSDP_STATE
            + "test_a_run_resumed_at_an_epochs_end_from_asynchronous_saves_goes_on_exactly",
        ),
    ),
    launched(
        "state-folder-optimizer-not-loaded",
        "load",
        "a sharded net's load_state leaves its optimizer's state as it was",
        "accel_mixin/resume/load.py",
        '    load_optimizer_from(owner, optimizer, source, entry.keys, source, name + "_")\n',
        "",
        (FSDP_STATE + "test_a_run_resumed_inside_an_epoch_goes_on_exactly",),
    ),
    launched(
        "state-folder-spread-differs-per-rank",
        "state_folder",
        "each rank shares out a DDP state's tensors its own way: some written twice, some never",
        "accel_mixin/resume/state_folder.py",
        "    for key in sorted(entries, key=lambda key: (-_size(entries[key]), key)):\n",
        "    for key in sorted(entries, reverse=rank == 0):\n",
        (
            "tests/test_state_folder.py::"
            "test_on_two_processes_each_rank_writes_its_part_of_one_folder",
        ),
    ),
    Break(
        "load-aside-state-unnamed",
        "load",
        "a state that a crash between a commit's two renames left aside is not named",
        "accel_mixin/resume/load.py",
        "        if aside:\n",
        "        if False:\n",
        (
            "tests/test_state_folder.py::"
            "test_a_state_left_aside_by_a_crash_between_the_renames_is_named",
        ),
    ),
    # --- issue 47: a fit in one direction ---
    Break(
        "notifications-per-batch-error-unnamed",
        "notifications",
        "an error in a per-batch notification no longer fails the section around it",
        "accel_mixin/training/notifications.py",
        "        control.fail(method_name, exc)\n",
        "        pass\n",
        (COORDINATION + "test_an_error_in_a_per_batch_notification_is_named_on_the_other_rank",),
    ),
    Break(
        "epochs-epoch-end-swallows-an-error",
        "epochs",
        "the epoch's end swallows an error leaving its block on one process",
        "accel_mixin/training/epochs.py",
        "        if not distributed:\n            raise\n",
        "        if not distributed:\n            return\n",
        ("tests/test_notifications.py::test_an_error_in_on_epoch_end_leaves_fit_as_itself",),
    ),
    Break(
        "epochs-epoch-end-swallows-a-stop",
        "epochs",
        "the epoch's end swallows EarlyStopping's KeyboardInterrupt: training goes on",
        "accel_mixin/training/epochs.py",
        "        raise interrupt or KeyboardInterrupt\n",
        "        return\n",
        (
            "tests/test_notifications.py::"
            + "test_a_keyboard_interrupt_in_on_epoch_end_stops_after_the_epoch_finished",
        ),
    ),
    # --- issue 47: a net pickled mid-fit with a main-process-only callback ---
    Break(
        "notifications-pickled-wrapper",
        "notifications",
        "a net pickled mid-fit (Checkpoint's f_pickle) holds the wrapper of a "
        "main-process-only callback, which recurses when unpickled",
        "accel_mixin/training/notifications.py",
        "    def __reduce__(self)",
        "    def _not_reduce(self)",
        (
            "tests/test_notifications.py::"
            + "test_a_net_pickled_mid_fit_holds_the_user_s_main_process_only_callback",
        ),
    ),
    # --- issue 47: the saves in flight are their net's ---
    Break(
        "checkpointing-load-waits-for-every-net",
        "checkpointing",
        "a load waits for every asynchronous save of the process: another net's "
        "stalled storage holds it up to io_timeout",
        "accel_mixin/net/saving.py",
        "        self._coordinator.run(self._wait_for_my_saves, what=label)\n",
        # DCP's writing threads, whichever net's
        "        def every():\n"
        "            for thread in __import__('threading').enumerate():\n"
        "                if thread.name.startswith('AsyncCheckpointExecutor'):\n"
        "                    thread.join(self.io_timeout)\n"
        "            self._wait_for_my_saves()\n\n"
        "        self._coordinator.run(every, what=label)\n",
        ("tests/test_state_folder.py::test_a_load_waits_for_its_own_net_s_save_not_for_another_s",),
    ),
    # --- issue 47: save_on_each_node states ---
    launched(
        "machine-copies-written-together",
        "checkpointing",
        "with save_on_each_node on several machines the ranks write one state together: "
        "only node 0 gets a whole one",
        "accel_mixin/net/saving.py",
        "            alone = ranks is not None",
        "            alone = False",
        (FILES + "test_resume_training_takes_the_newest_epoch_every_node_has",),
    ),
    launched(
        "machine-copies-committed-on-rank-0-only",
        "dcp_folder",
        "a machine's copy, written alone, is committed by rank 0 only: node 1's stays partial",
        "accel_mixin/checkpoint/dcp_folder.py",
        "    commits = alone or not _distributed()",
        "    commits = not _distributed()",
        (FILES + "test_resume_training_takes_the_newest_epoch_every_node_has",),
    ),
    launched(
        "machine-copies-rank-entries-not-gathered",
        "machine_copies",
        "each machine's copy holds its own writer's generators and part of the epoch only",
        "accel_mixin/checkpoint/machine_copies.py",
        "        merged.update(mine)\n",
        "        merged.update(gathered[accelerator.process_index][1])\n",
        (FILES + "test_copies_of_each_node_resume_inside_an_epoch_exactly",),
    ),
    launched(
        "machine-copies-one-machine-alone",
        "machine_copies",
        "save_on_each_node on one machine: its main process writes the state alone",
        "accel_mixin/checkpoint/machine_copies.py",
        "    if sum(writes for writes, _ in gathered) < 2:\n",
        "    if sum(writes for writes, _ in gathered) < 1:\n",
        (FILES + "test_save_on_each_node_on_one_machine_saves_one_state_together",),
    ),
    launched(
        "machine-copies-sharded-accepted",
        "machine_copies",
        "a module FSDP2 shards is saved as copies per machine, which hold no whole state",
        "accel_mixin/checkpoint/machine_copies.py",
        "    if sharded(accelerator):\n",
        "    if False:\n",
        (FILES + "test_sharded_copies_on_each_node_are_refused",),
    ),
    launched(
        "machine-copies-async-let-go-on-failure",
        "checkpointing",
        "where another machine's copy fails, a machine's asynchronous save in flight is let go",
        "accel_mixin/net/saving.py",
        "                if alone:  # where another machine's copy fails",
        "                if False:  # where another machine's copy fails",
        (FILES + "test_a_failed_copy_raises_on_every_node",),
    ),
    launched(
        "machine-copies-no-own-group",
        "checkpointing",
        "a machine's copy is saved with no group: DCP's writer thread warns on every machine",
        "accel_mixin/net/saving.py",
        "                    group=saves.own_group() if alone else group,",
        "                    group=group,",
        (FILES + "test_copies_of_each_node_resume_inside_an_epoch_exactly",),
    ),
    # --- issue 47: a fit in one direction (the loaded plan, the fit the callbacks hold) ---
    Break(
        "plan-kept-after-fit",
        "net",
        "the loaded plan stays for the fits after the one that went on from it",
        "accel_mixin/net/mixin.py",
        "        plan = local.fit.plan = local.loaded\n        local.loaded = None\n",
        "        plan = local.fit.plan = local.loaded\n",
        (RESUME + "test_load_state_fit_and_fit_again_the_second_fit_starts_over",),
    ),
    Break(
        "callbacks-fit-pickled",
        "callbacks",
        "the callbacks pickle the fit they hold: a net pickled inside a fit raises",
        "accel_mixin/callbacks.py",
        '        state.pop("_fit", None)\n',
        "",
        (RESUME + "test_a_net_with_the_callbacks_pickles_inside_a_fit",),
    ),
    # --- issue 47: NetLocal and StateSaves ---
    Break(
        "state-saves-fit-error-not-finished",
        "state_saves",
        "a fit that raises before its asynchronous save in flight is committed",
        "accel_mixin/checkpoint/state_saves.py",
        "            try:\n                self.wait(io_timeout)\n",
        "            try:\n                pass\n",
        ("tests/test_state_folder.py::test_a_fit_that_raises_finishes_its_save_in_flight_first",),
    ),
    Break(
        "local-dropped-by-getstate",
        "net",
        "a pickled or cloned net carries the process-local holder (prepared objects, saves)",
        "accel_mixin/net/mixin.py",
        "        state.pop(LOCAL, None)\n",
        "",
        ("tests/test_portable.py",),
    ),
    # --- issue 47: renames (training/shuffling.py had no break of its own) ---
    Break(
        "shuffling-not-reseeded",
        "shuffling",
        "the sampler's generator is not reseeded from the global one at each epoch",
        "accel_mixin/training/shuffling.py",
        "        generator.manual_seed(broadcast_object_list(seed)[0])\n",
        "        broadcast_object_list(seed)\n",
        ("tests/test_shuffling.py",),
    ),
    # --- issue 47: the asynchronous save's stall ---
    Break(
        "state_saves-stager-not-kept",
        "state_saves",
        "each asynchronous save stages into a new CPU copy, allocated anew",
        "accel_mixin/checkpoint/state_saves.py",
        "        if self.kept is None:\n",
        "        if True:\n",
        ("tests/test_state_folder.py",),
    ),
    Break(
        "state_saves-stalled-save-copy-reused",
        "state_saves",
        "the next save stages into the copy a stalled save still writes from",
        "accel_mixin/checkpoint/state_saves.py",
        "                self.let_go_of_the_copy()  # the stalled write still reads it\n",
        "                pass\n",
        ("tests/test_state_folder.py",),
    ),
    # --- issue 48: accelerate's trackers, settings only prepare() applies ---
    launched(
        "trackers-rows-not-logged",
        "trackers",
        "the epoch rows never reach accelerate's trackers",
        "accel_mixin/training/epochs.py",
        "    log_row(net.accelerator, net.history[-1])\n",
        "",
        (
            "tests/test_trackers.py",
            SYNC + "test_accelerate_trackers_get_each_row_once_from_the_main_process",
        ),
    ),
    Break(
        "trackers-started-over-the-scripts",
        "trackers",
        "the net starts the trackers again where the script started them",
        "accel_mixin/training/trackers.py",
        "    if accelerator.log_with and not accelerator.trackers:\n",
        "    if accelerator.log_with:\n",
        ("tests/test_trackers.py",),
    ),
    Break(
        "trackers-flags-logged",
        "trackers",
        "the row's flags (valid_loss_best) go to the trackers as numbers",
        "accel_mixin/training/trackers.py",
        " and not isinstance(value, bool)",
        "",
        ("tests/test_trackers.py",),
    ),
    Break(
        "trackers-last-epoch-of-early-stopping-lost",
        "trackers",
        "the row is logged only when training goes on: EarlyStopping's last epoch is lost",
        "accel_mixin/training/epochs.py",
        "    log_row(net.accelerator, net.history[-1])\n",
        "    if not stop:\n        log_row(net.accelerator, net.history[-1])\n",
        ("tests/test_trackers.py",),
    ),
    Break(
        "parallelism-model-parallel-accepted",
        "parallelism",
        "tensor, context and sequence parallelism train without a word",
        "accel_mixin/distributed/parallelism.py",
        "            if size > 1:\n",
        "            if size > 99:\n",
        ("tests/test_parallelism.py",),
    ),
    Break(
        "parallelism-fp8-accepted",
        "parallelism",
        "FP8 trains in full precision without a word",
        "accel_mixin/distributed/parallelism.py",
        '    if backend.upper() != "NO" or precision == "fp8":\n',
        "    if False:\n",
        ("tests/test_parallelism.py",),
    ),
    launched(
        "sharding-hsdp-cut-as-one-dimension",
        "sharding",
        "a full tensor loaded into HSDP is cut as if sharded across every process",
        "accel_mixin/distributed/sharding.py",
        "    return distribute_tensor(full, like.device_mesh, like.placements,"
        " src_data_rank=None)\n",
        "    from torch.distributed.tensor import Shard  # noqa: PLC0415\n\n"
        "    placements = [Shard(0)] * like.device_mesh.ndim\n"
        "    return distribute_tensor(full, like.device_mesh, placements, src_data_rank=None)\n",
        ("tests/test_hsdp.py",),
    ),
    # --- issue 48: streams ---
    launched(
        "streams-split-shared-again",
        "streams",
        "a stream that splits itself by rank is shared again: all but one share is lost",
        "accel_mixin/training/streams.py",
        '    return "split" if len(set(found)) == len(found) else None\n',
        '    return "plain" if len(set(found)) == len(found) else None\n',
        ("tests/test_streams.py",),
    ),
    launched(
        "streams-padding-weighs-as-real",
        "streams",
        "a rank whose stream ended trains its last batch again as real samples",
        "accel_mixin/training/streams.py",
        "                self.real, self.weight = real, real * self.processes / samples\n",
        "                self.real, self.weight = real, 1.0\n",
        ("tests/test_streams.py",),
    ),
    Break(
        "streams-position-read-ahead",
        "streams",
        "the position recorded is the batch read ahead: a resume skips a batch",
        "accel_mixin/training/streams.py",
        "                    real, self._state, self._before = samples_in(current), after,"
        " before\n",
        "                    real, self._state, self._before = samples_in(current),"
        " window[1][1] or after, before\n",
        (
            "tests/test_streams.py::test_on_one_process_a_stream_resumes_inside_an_epoch_exactly_reading_on",
        ),
    ),
    Break(
        "streams-unstateful-saved-inside-epochs",
        "streams",
        "a stream without state_dict saves inside epochs, and a resume reads it all again",
        "accel_mixin/training/streams.py",
        "    if stateful and not keeps_state(dataset):\n",
        "    if False:\n",
        ("tests/test_mid_epoch.py",),
    ),
    launched(
        "streams-ended-rank-resumes-without-a-batch",
        "streams",
        "a rank whose stream had ended at the save has no batch to pad with on resume",
        "accel_mixin/training/streams.py",
        '        if resumed is not None and resumed.get("ended"):\n',
        "        if False:\n",
        ("tests/test_streams.py",),
    ),
    launched(
        "streams-every-rank-reads-its-own-order",
        "streams",
        "a plain stream read by every rank is not synchronized: each rank its own order",
        "accel_mixin/training/streams.py",
        "            synchronize_rng_states(types, generator)\n",
        "            pass\n",
        ("tests/test_streams.py",),
    ),
    Break(
        "wrapping-epoch-schedule-waits-for-the-optimizers",
        "wrapping",
        "an epoch that ends inside a window of accumulation does not step an epoch's scheduler",
        "accel_mixin/training/wrapping.py",
        "        prepared.step_with_optimizer = False\n",
        "        prepared.split_batches = True\n",
        ("tests/test_settings.py",),
    ),
    Break(
        "internals-dispatcher-asked-for-a-generator",
        "internals",
        "a Dataset dispatched from the main process cannot train",
        "accel_mixin/internals.py",
        '    names = ("iteration",) if dispatches(dataloader) else ("synchronized_generator", '
        '"iteration")\n',
        '    names = ("synchronized_generator", "iteration")\n',
        ("tests/test_settings.py",),
    ),
    Break(
        "internals-dispatched-saved-inside-epochs",
        "internals",
        "saves inside epochs of dispatched data skip the wrong batches on resume",
        "accel_mixin/internals.py",
        "    if dispatches(dataloader):\n        raise ValueError(",
        "    if False:\n        raise ValueError(",
        ("tests/test_settings.py",),
    ),
    launched(
        "shares-dispatched-last-batch-counted-twice",
        "shares",
        "a dispatched stream's last batch, split between the ranks, counts on each",
        "accel_mixin/training/shares.py",
        "    return process_index * data_batch < step\n",
        "    return True\n",
        ("tests/test_streams.py",),
    ),
    # --- issue 48: object storage ---
    Break(
        "object-states-commit-removes-its-own-version",
        "object_states",
        "a save on an object store removes every version once committed, its own too",
        "accel_mixin/checkpoint/object_states.py",
        "    _remove_versions(url, keep=version)\n",
        "    _remove_versions(url, keep=None)\n",
        (OS + "test_save_state_commits_a_new_version_and_removes_the_old",),
    ),
    Break(
        "object-states-uncommitted-taken-as-state",
        "object_states",
        "a state on an object store counts as saved without its commit marker",
        "accel_mixin/checkpoint/dcp_folder.py",
        "        return object_states.committed_version(str(path)) is not None\n",
        "        return storage.exists(str(path))\n",
        (OS + "test_a_state_without_a_commit_is_no_state",),
    ),
    Break(
        "object-states-killed-saves-left",
        "object_states",
        "what a killed save left on an object store stays there for good",
        "accel_mixin/checkpoint/object_states.py",
        "        if keep is None:\n            storage.remove(url)\n",
        "        if keep is None:\n            pass\n",
        (OS + "test_a_state_without_a_commit_is_no_state",),
    ),
    Break(
        "remote-files-named-by-the-local-copy",
        "remote_files",
        "an error about a file at a URL names its temporary local copy",
        "accel_mixin/checkpoint/remote_files.py",
        "        if text == said:\n            raise\n",
        "        raise\n",
        (OS + "test_a_damaged_file_at_a_url_is_named_by_its_url",),
    ),
    Break(
        "storage-stale-listings",
        "storage",
        "fsspec's cached listings are trusted: a rank misses what another rank wrote",
        "accel_mixin/checkpoint/storage.py",
        "    fs.invalidate_cache(path)\n    return fs, path\n",
        "    return fs, path\n",
        (OS + "test_a_listing_sees_what_another_process_wrote_since",),
    ),
]


class Stale(Exception):
    """A break's snippet no longer occurs exactly once in its file."""


def git_clean(path):
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return status.stdout.strip() == ""


def first_failure(output, kind="FAILED"):
    """The id of the first test pytest's ``-q`` output reports as ``kind``
    (FAILED: an assertion or an error in the test; ERROR: in a fixture)."""
    match = re.search(rf"^{kind} (.+?)(?: - .*)?$", output, re.MULTILINE)
    return match.group(1) if match else ""


def run_tests(brk, log):
    """Run the break's tests; returns (result, caught_by)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly"]
    command += list(brk.tests)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=brk.timeout)
        except subprocess.TimeoutExpired:
            kill_job(proc)
            return "error (timeout)", ""
        except BaseException:  # Ctrl-C, SIGTERM: no job left on a broken tree
            kill_job(proc)
            raise
    output = Path(log).read_text(errors="replace")
    if rc == 0:
        return "NOT CAUGHT", ""
    failed = first_failure(output)
    if rc == 1 and failed:
        return "caught", failed
    # an error in a fixture (a launch that timed out, say) proves nothing
    return f"error (pytest exit {rc})", first_failure(output, "ERROR")


def apply_and_test(brk, logs):
    path = ROOT / brk.file
    original = path.read_text()
    count = original.count(brk.old)
    if count != 1:
        raise Stale(
            f"break {brk.name!r}: the snippet occurs {count} times in "
            f"{brk.file}, not once; update the break to the current code:\n"
            f"{brk.old}"
        )
    log = Path(logs) / f"{brk.name}.log"
    try:
        path.write_text(original.replace(brk.old, brk.new))
        return run_tests(brk, log)
    finally:
        path.write_text(original)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="breaks to run")
    parser.add_argument("--list", action="store_true", help="list the breaks")
    parser.add_argument("--logs", help="folder for each run's pytest output")
    args = parser.parse_args(argv)

    names = [brk.name for brk in BREAKS]
    duplicates = {name for name in names if names.count(name) > 1}
    if duplicates:
        parser.error(f"duplicate break names: {sorted(duplicates)}")
    selected = BREAKS
    if args.only:
        unknown = set(args.only) - set(names)
        if unknown:
            parser.error(f"no such break: {sorted(unknown)}; see --list")
        selected = [brk for brk in BREAKS if brk.name in args.only]
    for brk in selected:
        text = (ROOT / brk.file).read_text()
        if text.count(brk.old) != 1:
            raise Stale(
                f"break {brk.name!r}: the snippet occurs {text.count(brk.old)} "
                f"times in {brk.file}, not once; update it to the current code"
            )
    if args.list:
        for brk in selected:
            print(f"{brk.name:38} {brk.module:18} {brk.breaks}")
        return 0

    dirty = sorted({brk.file for brk in selected if not git_clean(ROOT / brk.file)})
    if dirty:
        sys.exit(f"uncommitted changes in {dirty}: commit or stash them first")

    # a SIGTERM (a CI job cancelled) unwinds like Ctrl-C: the file is restored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = args.logs or tempfile.mkdtemp(prefix="accel-mixin-breaks-")
    Path(logs).mkdir(parents=True, exist_ok=True)
    print(f"pytest output of each break: {logs}", flush=True)
    rows = []
    start = time.monotonic()
    for brk in selected:
        began = time.monotonic()
        result, caught_by = apply_and_test(brk, logs)
        seconds = time.monotonic() - began
        rows.append((brk, result, caught_by, seconds))
        print(f"{brk.name}: {result} {caught_by} ({seconds:.0f} s)", flush=True)

    print()
    print("| break | module | breaks | tests run | result | caught by | s |")
    print("|---|---|---|---|---|---|---|")
    for brk, result, caught_by, seconds in rows:
        tests = " ".join(brk.tests)
        print(
            f"| {brk.name} | {brk.module} | {brk.breaks} | {tests} | {result} "
            f"| {caught_by} | {seconds:.0f} |"
        )
    uncaught = [brk.name for brk, result, _, _ in rows if result != "caught"]
    total = time.monotonic() - start
    print(f"\n{len(rows) - len(uncaught)}/{len(rows)} caught in {total:.0f} s")
    if uncaught:
        print(f"not caught: {' '.join(uncaught)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
