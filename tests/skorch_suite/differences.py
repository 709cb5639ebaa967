"""The tests of skorch's own suite that fail with AccelerateMixin, and why.

Kept apart from plugin.py, which substitutes skorch's classes when it is
imported, so that tests/test_skorch_suite.py can read the lists without it.
"""

__all__ = ["ARTIFACTS", "DIFFERENCES", "NOT_IN_THE_WHEEL"]

_DEVICE_NONE = (
    "device must be None: the accelerator places the modules (a device= "
    "that disagrees with it would split a model between devices)"
)
_PLACED_BY_ACCELERATE = (
    "the accelerator moves modules when it prepares them, after the optimizers "
    "are built, as in every accelerate script, with torch.device objects; the "
    "parameters keep their identity, so the optimizers stay right"
)
_MMAP = (
    "module files are loaded with mmap=True besides skorch's torch_load_kwargs, so "
    "that loading adds one file's size to peak memory, not two"
)

# test (class::name, without parameters) -> why accel_mixin differs on purpose;
# the guide's docs/guide/differences.md lists the same
DIFFERENCES = {
    "TestNeuralNet::test_device_torch_device": _DEVICE_NONE,
    "TestNeuralNet::test_moving_custom_modules_to_device": _DEVICE_NONE,
    "TestNeuralNet::test_pickle_save_load_device_is_none": (
        "with device=None, loading maps to the CPU and leaves placement to the "
        "accelerator, without skorch's DeviceWarning"
    ),
    "TestNeuralNet::test_set_params_on_custom_module_preserves_its_device": _PLACED_BY_ACCELERATE,
    "TestNeuralNet::test_optimizer_initialized_after_module_moved_to_device": _PLACED_BY_ACCELERATE,
    "TestNeuralNet::test_torch_load_kwargs_auto_weights_only_true_when_load_params": _MMAP,
    "TestNeuralNet::test_torch_load_kwargs_forwarded_to_torch_load": _MMAP,
    "TestNeuralNet::test_torch_load_kwargs_auto_weights_true": _MMAP,
}

# not differences of accel_mixin: what the substitution itself changes
ARTIFACTS = {
    "TestNeuralNet::test_repr_uninitialized_works": (
        "the repr names the class's module, this plugin instead of skorch.net"
    ),
    "TestNeuralNet::test_repr_initialized_works": "as test_repr_uninitialized_works",
    "TestNeuralNet::test_repr_fitted_works": "as test_repr_uninitialized_works",
}

# fail with skorch's own classes too (see ACCEL_MIXIN_SKORCH_SUITE=plain)
NOT_IN_THE_WHEEL = {
    "TestNeuralNet::test_pickle_load": "skorch/tests/net_cuda.pkl is not in skorch's wheel",
    "TestNeuralNet::test_load_cuda_params_to_cpu": (
        "skorch/tests/*_cuda.pt are not in skorch's wheel"
    ),
}
