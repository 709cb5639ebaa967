"""skorch's own tests, with AccelerateMixin in front of skorch's nets.

A pytest plugin: before skorch's test modules import them, ``NeuralNet``,
``NeuralNetClassifier``, ``NeuralNetBinaryClassifier`` and
``NeuralNetRegressor`` are replaced, in skorch's namespaces, by subclasses
with ``AccelerateMixin`` in front and a default ``Accelerator()``; one
process, as skorch's tests run. scripts/test runs it:

    PYTHONPATH=tests/skorch_suite python -m pytest -p plugin \\
        --confcutdir=tests/skorch_suite --pyargs skorch.tests.test_net \\
        skorch.tests.test_classifier skorch.tests.test_regressor

The tests that fail on purpose are listed in ``DIFFERENCES``, each with its
reason (the README's "Deliberate differences from skorch"): they run as
strict expected failures, so one that starts to pass is reported.
"""
import os

import pytest
import skorch
import skorch.classifier
import skorch.net
import skorch.regressor
from accelerate import Accelerator

from accel_mixin import AccelerateMixin

__all__ = ['DIFFERENCES']

ORIGINALS = {
    'NeuralNet': skorch.net.NeuralNet,
    'NeuralNetClassifier': skorch.classifier.NeuralNetClassifier,
    'NeuralNetBinaryClassifier': skorch.classifier.NeuralNetBinaryClassifier,
    'NeuralNetRegressor': skorch.regressor.NeuralNetRegressor,
}


def _accelerated(name, base):
    def __init__(self, *args, accelerator=None, **kwargs):
        if accelerator is None:
            accelerator = Accelerator()
        super(cls, self).__init__(*args, accelerator=accelerator, **kwargs)

    cls = type(name, (AccelerateMixin, base), {'__init__': __init__, '__module__': __name__})
    return cls


# module attributes, so that pickles find the classes by name
NeuralNet = _accelerated('NeuralNet', ORIGINALS['NeuralNet'])
NeuralNetClassifier = _accelerated('NeuralNetClassifier', ORIGINALS['NeuralNetClassifier'])
NeuralNetBinaryClassifier = _accelerated(
    'NeuralNetBinaryClassifier', ORIGINALS['NeuralNetBinaryClassifier'])
NeuralNetRegressor = _accelerated('NeuralNetRegressor', ORIGINALS['NeuralNetRegressor'])

# ACCEL_MIXIN_SKORCH_SUITE=plain runs the suite on skorch's own classes: the
# baseline, to tell what fails here whatever the net
PLAIN = os.environ.get('ACCEL_MIXIN_SKORCH_SUITE') == 'plain'

# where skorch's tests import them from; not in skorch.classifier and
# skorch.regressor for the classes they define, whose methods call
# ``super(NeuralNetClassifier, self)`` by the module's global name
if not PLAIN:
    for _name in ORIGINALS:
        setattr(skorch, _name, globals()[_name])
    skorch.net.NeuralNet = NeuralNet
    skorch.classifier.NeuralNetBinaryClassifier = NeuralNetBinaryClassifier


_DEVICE_NONE = (
    "device must be None: the accelerator places the modules (a device= "
    "that disagrees with it would split a model between devices)")
_PLACED_BY_ACCELERATE = (
    "the accelerator moves modules when it prepares them, after the optimizers "
    "are built, as in every accelerate script, with torch.device objects; the "
    "parameters keep their identity, so the optimizers stay right")
_MMAP = (
    "module files are loaded with mmap=True besides skorch's torch_load_kwargs, so "
    "that loading adds one file's size to peak memory, not two")

# test (class::name, without parameters) -> why accel_mixin differs on purpose;
# the README's "Deliberate differences from skorch" lists the same
DIFFERENCES = {
    'TestNeuralNet::test_device_torch_device': _DEVICE_NONE,
    'TestNeuralNet::test_moving_custom_modules_to_device': _DEVICE_NONE,
    'TestNeuralNet::test_pickle_save_load_device_is_none': (
        "with device=None, loading maps to the CPU and leaves placement to the "
        "accelerator, without skorch's DeviceWarning"),
    'TestNeuralNet::test_set_params_on_custom_module_preserves_its_device':
        _PLACED_BY_ACCELERATE,
    'TestNeuralNet::test_optimizer_initialized_after_module_moved_to_device':
        _PLACED_BY_ACCELERATE,
    'TestNeuralNet::test_torch_load_kwargs_auto_weights_only_true_when_load_params': _MMAP,
    'TestNeuralNet::test_torch_load_kwargs_forwarded_to_torch_load': _MMAP,
    'TestNeuralNet::test_torch_load_kwargs_auto_weights_true': _MMAP,
}

# not differences of accel_mixin: what the substitution itself changes
ARTIFACTS = {
    'TestNeuralNet::test_repr_uninitialized_works': (
        "the repr names the class's module, this plugin instead of skorch.net"),
    'TestNeuralNet::test_repr_initialized_works': 'as test_repr_uninitialized_works',
    'TestNeuralNet::test_repr_fitted_works': 'as test_repr_uninitialized_works',
}

# fail with skorch's own classes too (see ACCEL_MIXIN_SKORCH_SUITE=plain)
NOT_IN_THE_WHEEL = {
    'TestNeuralNet::test_pickle_load': "skorch/tests/net_cuda.pkl is not in skorch's wheel",
    'TestNeuralNet::test_load_cuda_params_to_cpu': (
        "skorch/tests/*_cuda.pt are not in skorch's wheel"),
}


def _test_name(item):
    return item.nodeid.split('[')[0].split('::', 1)[-1]


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        name = _test_name(item)
        if name in NOT_IN_THE_WHEEL:
            dropped.append(item)
            continue
        kept.append(item)
        reason = None if PLAIN else DIFFERENCES.get(name) or ARTIFACTS.get(name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
