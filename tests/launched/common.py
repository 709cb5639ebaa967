"""Shared pieces of the scripts that tests launch under several processes."""

import faulthandler
import gc
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import InitProcessGroupKwargs
from skorch import NeuralNetClassifier
from skorch.hf import AccelerateMixin as IncumbentMixin

from accel_mixin import AccelerateMixin

__all__ = [
    "MLP",
    "AcceleratedNet",
    "Checks",
    "DropoutMLP",
    "IncumbentNet",
    "LogitMLP",
    "ParamNLLLoss",
    "TwoStageNet",
    "error_and_seconds",
    "make_accelerator",
    "make_data",
    "make_fsdp_accelerator",
    "outcome",
    "report",
]


class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
    """Ours."""


class IncumbentNet(IncumbentMixin, NeuralNetClassifier):
    """skorch.hf.AccelerateMixin, to show the defects we fix."""


class TwoStageNet(AcceleratedNet):
    """Two modules in the forward pass: ``module_`` then ``module2_``."""

    def initialize_module(self):
        super().initialize_module()
        self.module2_ = torch.nn.Linear(2, 2)
        return self

    def infer(self, x, **fit_params):
        return torch.softmax(self.module2_(super().infer(x, **fit_params)), dim=-1)


def make_accelerator(**kwargs):
    """An Accelerator whose collectives give up after 30 s instead of 30 min."""
    handlers = kwargs.pop("kwargs_handlers", [])
    handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=30)))
    return Accelerator(kwargs_handlers=handlers, **kwargs)


def make_fsdp_accelerator(fsdp_version=2, plugin=None, **kwargs):
    """Test only: an accelerator that shards with FSDP on CPU processes.

    accelerate selects ``DistributedType.FSDP`` for GPU kinds only
    (``accelerate/state.py``), and FSDP2 itself runs on CPU over gloo; so on
    CPU the accelerator's state is set as accelerate sets it on GPUs, after
    the accelerator was created: the FSDP type (in the partial state too,
    which every later ``AcceleratorState()`` copies), the plugin, and the
    plugin's mixed precision policy from the accelerator's
    ``mixed_precision``. ``plugin`` holds the plugin's other settings. The
    plugin is not passed to ``Accelerator``, which would set
    ``ACCELERATE_USE_FSDP`` for every later accelerator of the process.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp_version, **(plugin or {}))
    accelerator = make_accelerator(**kwargs)
    state = AcceleratorState()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    partial = PartialState._shared_state  # pylint: disable=protected-access
    _PARTIAL_TYPE.setdefault("distributed_type", partial["distributed_type"])
    partial["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    return accelerator


def make_hsdp_accelerator(replicate, shard, **kwargs):
    """Test only: ``make_fsdp_accelerator`` with HSDP, FSDP2 on a
    ``replicate`` x ``shard`` mesh: the ``ParallelismConfig`` and its device
    mesh set on the state as accelerate sets them on GPUs (on CPU it refuses
    a ``ParallelismConfig`` of several processes, MULTI_CPU being no "multi
    device" to it)."""
    from accelerate.utils import ParallelismConfig

    accelerator = make_fsdp_accelerator(**kwargs)
    config = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)
    state = AcceleratorState()
    state.parallelism_config = config
    state.device_mesh = config.build_device_mesh("cpu")
    return accelerator


# the partial state's type before make_fsdp_accelerator set FSDP there
_PARTIAL_TYPE = {}


def fresh_state():
    """Forget the accelerator state of this process, keeping its process group
    (and the type it had before an FSDP accelerator)."""
    AcceleratorState._reset_state()  # pylint: disable=protected-access
    GradientState._reset_state()  # pylint: disable=protected-access
    PartialState._shared_state.update(_PARTIAL_TYPE)  # pylint: disable=protected-access


def seeded_net(max_epochs, callbacks=(), accelerator=None, **kwargs):
    """A net with Adam, batches of 16 and torch's seed 0, on a new
    ``accelerator()`` (``make_accelerator`` by default) once the previous
    accelerator state is forgotten."""
    fresh_state()
    torch.manual_seed(0)
    return AcceleratedNet(
        MLP,
        accelerator=(accelerator or make_accelerator)(),
        max_epochs=max_epochs,
        batch_size=16,
        optimizer=torch.optim.Adam,
        verbose=0,
        callbacks=list(callbacks),
        **kwargs,
    )


def make_data(n=600, n_features=20, seed=0, noise=0.0):
    """A classification problem, the same on every rank."""
    from sklearn.datasets import make_classification

    X, y = make_classification(n, n_features, n_informative=10, random_state=seed, flip_y=noise)
    return X.astype(np.float32), y.astype(np.int64)


class DropoutMLP(torch.nn.Module):
    """Outputs probabilities; dropout draws from the random number generators."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(20, 32),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(32, 2),
            torch.nn.Softmax(dim=-1),
        )

    def forward(self, X):
        return self.layers(X)


class MLP(torch.nn.Module):
    """Outputs probabilities, for skorch's default NLLLoss."""

    def __init__(self, n_features=20, hidden=32, n_classes=2):
        super().__init__()
        self.hidden = torch.nn.Linear(n_features, hidden)
        self.out = torch.nn.Linear(hidden, n_classes)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


class LogitMLP(MLP):
    """Outputs logits, for CrossEntropyLoss."""

    def forward(self, X):
        return self.out(torch.relu(self.hidden(X)))


class ParamNLLLoss(torch.nn.NLLLoss):
    """The user-side workaround that lets the incumbent fit in several
    processes: a criterion with a trainable parameter, so that DDP accepts it.
    Not needed with accel_mixin."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, y_pred, y_true):
        return super().forward(torch.log(y_pred + 1e-7), y_true) + 0.0 * self.dummy.sum()


def _rank():
    return int(os.environ.get("RANK", "0"))


def write_report(payload):
    """Write this rank's report, and nothing else (a rank about to die, or
    one that reports again later)."""
    out = Path(os.environ.get("ACCEL_RESULTS_DIR", "."))
    tmp = out / f"rank{_rank()}.json.tmp"
    tmp.write_text(json.dumps(payload, default=str))
    os.replace(tmp, out / f"rank{_rank()}.json")


def report(payload):
    """Write this rank's results for the test to read."""
    write_report(payload)
    # as a script ends with accelerator.end_training()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def outcome(fn):
    """What ``fn`` raised, as "Type: message", or None if it returned."""
    try:
        fn()
    except Exception as exc:  # pylint: disable=broad-except
        return f"{type(exc).__name__}: {exc}"
    return None


def error_and_seconds(fn):
    """What ``fn`` raised on this rank (None if nothing), and how long it took."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # pylint: disable=broad-except
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


HUNG_STATUS = 124  # as timeout(1) ends what it stopped


class Checks:
    """Named checks run in order on every rank; each records a value or error.

    Every rank runs every check, so collectives stay in step as long as a
    check fails alike on all ranks. Many scenarios share one launch this way,
    so that the suite pays the start-up of a process group once, and each
    check has a deadline of its own: a check that does not end within it
    (a collective that waits forever, a deadlock) ends its rank with status
    ``HUNG_STATUS``, after writing the rank's report as ``{"hung": name,
    "deadline": seconds, "checks": <the checks before it>}`` and every
    thread's stack to stderr. The test then fails naming the case, and the
    rest of the suite goes on.

    Parameters
    ----------
    deadline : float (default=120)
      Seconds a check may take, unless it is run with a deadline of its own.
      A hang detector, not a timing assertion: generous on a busy machine.

    """

    def __init__(self, deadline=120):
        self.results = {}
        self.deadline = deadline

    def __call__(self, fn):
        """Run ``fn`` now, as the check named after it (a decorator)."""
        self.run(fn)
        return fn

    def within(self, seconds):
        """A decorator like the instance itself, with a deadline of ``seconds``."""

        def run_now(fn):
            self.run(fn, deadline=seconds)
            return fn

        return run_now

    def run(self, fn, name=None, deadline=None):
        """Run ``fn`` as the check ``name`` (default: its ``__name__``), for
        scenarios built in a loop; returns its result."""
        name = name or fn.__name__
        deadline = self.deadline if deadline is None else deadline
        start = time.monotonic()
        watchdog = threading.Timer(deadline, self._hung, (name, deadline))
        watchdog.daemon = True
        watchdog.start()
        try:
            self.results[name] = {"ok": True, "value": fn()}
        except Exception as exc:  # pylint: disable=broad-except
            traceback.print_exc(file=sys.stdout)
            self.results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            watchdog.cancel()
        self.results[name]["check_seconds"] = time.monotonic() - start
        return self.results[name]

    def _hung(self, name, deadline):
        print(
            f"check {name!r} hung: no end within {deadline} s; every thread's stack:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            write_report({"hung": name, "deadline": deadline, "checks": dict(self.results)})
        finally:
            # the hung check's thread cannot be stopped: end the process
            os._exit(HUNG_STATUS)  # pylint: disable=protected-access


def freeze_what_is_loaded():
    """Leave what is loaded now out of every later collection.

    A full ``gc.collect()`` walks every object torch and its imports made
    (about half a second here, as long as a case's fit); the cases collect
    after each other, and each needs only its own garbage found. torch
    imports its compiler on the first optimizer built: imported first, so
    that it is frozen too.
    """
    import torch._dynamo  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

    gc.collect()
    gc.freeze()


def accelerator_for(precision):
    """A new accelerator of ``precision`` (fp16: one of fp32, which the
    cases give a scaler), in the process group that there is."""
    # a precision is the accelerator state's for its life: a new state each
    fresh_state()
    return make_accelerator(**({"mixed_precision": "bf16"} if precision == "bf16" else {}))
