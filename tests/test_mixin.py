"""AccelerateMixin in one process.

Tests parametrized with ``NETS`` also run against skorch.hf.AccelerateMixin,
marked as a strict expected failure where it has the defect in question: if
the incumbent ever passed, the test would fail.
"""
import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, LRScheduler

from common import AcceleratedNet, IncumbentNet


def incumbent(reason):
    return pytest.param(
        IncumbentNet, marks=pytest.mark.xfail(strict=True, reason=reason),
        id='incumbent')


def ours():
    return pytest.param(AcceleratedNet, id='ours')


def make_net(Net, mlp, accelerator=None, **kwargs):
    params = dict(max_epochs=2, lr=0.1, batch_size=32, verbose=0)
    params.update(kwargs)
    return Net(mlp, accelerator=accelerator or Accelerator(cpu=True), **params)


def lengths(accelerator):
    return tuple(len(getattr(accelerator, name))
                 for name in ('_models', '_optimizers', '_schedulers', '_dataloaders'))


# --- construction and initialization ---------------------------------------

def test_device_must_be_left_to_the_accelerator(mlp):
    net = AcceleratedNet(mlp, accelerator=Accelerator(cpu=True), device='cpu')
    with pytest.raises(ValueError, match='set device=None'):
        net.initialize()


def test_closure_optimizer_is_refused_at_initialize(mlp):
    net = make_net(AcceleratedNet, mlp, optimizer=torch.optim.LBFGS)
    with pytest.raises(ValueError, match=r'optimizer_ \(LBFGS\) needs a closure'):
        net.initialize()


def test_initialize_accelerator_is_idempotent(mlp):
    net = make_net(AcceleratedNet, mlp).initialize()
    accelerator = net.accelerator
    objects = (net.module_, net.criterion_, net.optimizer_)
    for _ in range(3):
        net._initialize_accelerator()
    assert (net.module_, net.criterion_, net.optimizer_) == objects
    assert lengths(accelerator) == (2, 1, 0, 0)


def test_custom_modules_and_optimizers_are_prepared(mlp, data):
    class TwoModules(AcceleratedNet):
        def initialize_module(self):
            super().initialize_module()
            self.module2_ = torch.nn.Linear(2, 2)
            return self

        def initialize_optimizer(self, *args, **kwargs):
            super().initialize_optimizer(*args, **kwargs)
            self.optimizer2_ = torch.optim.SGD(self.module2_.parameters(), lr=0.1)
            return self

    accelerator = Accelerator(cpu=True, mixed_precision='bf16')
    net = make_net(TwoModules, mlp, accelerator, unwrap_after_train=False)
    net.fit(*data)
    assert isinstance(net.optimizer2_, AcceleratedOptimizer)
    assert '_original_forward' in vars(net.module2_)  # autocast patch
    assert any(m is net.module2_ for m in accelerator._models)


def test_default_criterion_gets_device_placement_and_autocast(mlp, data):
    accelerator = Accelerator(cpu=True, mixed_precision='bf16')
    net = make_net(AcceleratedNet, mlp, accelerator, unwrap_after_train=False)
    net.fit(*data)
    assert isinstance(net.criterion_, torch.nn.NLLLoss)
    assert '_original_forward' in vars(net.criterion_)


# --- training ----------------------------------------------------------------

@pytest.mark.parametrize('Net', [ours(), incumbent('zero_grad before backward drops accumulated gradients')])
def test_gradient_accumulation_equals_one_larger_batch(Net, mlp, data):
    X, y = data[0][:64], data[1][:64]
    common = dict(max_epochs=1, lr=0.5, train_split=None, verbose=0)
    torch.manual_seed(0)
    reference = NeuralNetClassifier(mlp, batch_size=16, **common).initialize()
    start = copy.deepcopy(reference.module_.state_dict())
    reference.partial_fit(X, y)

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = Net(mlp, accelerator=accelerator, batch_size=8, **common).initialize()
    accelerator.unwrap_model(net.module_).load_state_dict(start)
    net.partial_fit(X, y)

    for (name, expected), actual in zip(
            reference.module_.state_dict().items(),
            accelerator.unwrap_model(net.module_).state_dict().values()):
        torch.testing.assert_close(actual, expected, msg=name)


class RecordScheduler(Callback):
    def initialize(self):
        self.types_ = set()
        return self

    def on_batch_end(self, net, training=False, **kwargs):
        if training:
            scheduler = dict(net.callbacks_)['LRScheduler'].lr_scheduler_
            self.types_.add(type(scheduler).__name__)


@pytest.mark.parametrize('Net', [ours(), incumbent('passes the scheduler class to prepare')])
def test_the_stepping_scheduler_is_the_prepared_one(Net, mlp, data):
    X, y = data[0][:64], data[1][:64]
    recorder = RecordScheduler()
    net = make_net(
        Net, mlp, Accelerator(cpu=True, gradient_accumulation_steps=2),
        max_epochs=1, lr=1.0, batch_size=8, train_split=None,
        callbacks=[
            LRScheduler(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5,
                        step_every='batch'),
            recorder,
        ])
    net.fit(X, y)
    assert recorder.types_ == {'AcceleratedScheduler'}
    # 8 batches, 4 optimizer steps: the schedule follows the optimizer
    assert net.optimizer_.param_groups[0]['lr'] == pytest.approx(0.5 ** 4)


def test_reduce_lr_on_plateau_gets_the_score(mlp, data):
    net = make_net(
        AcceleratedNet, mlp, max_epochs=4, lr=0.1,
        callbacks=[LRScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau,
                               monitor=lambda net: 1.0, patience=0, factor=0.5)])
    net.fit(*data)
    # the constant score stops improving after the first epoch
    assert net.optimizer_.param_groups[0]['lr'] == pytest.approx(0.1 * 0.5 ** 3)


@pytest.mark.parametrize('Net', [ours(), incumbent('prints with accelerator.print whatever verbose says')])
def test_verbose_0_prints_nothing(Net, mlp, data, capsys):
    make_net(Net, mlp, verbose=0).fit(*data)
    assert capsys.readouterr().out == ''


def test_verbose_1_prints_the_epoch_table(mlp, data, capsys):
    make_net(AcceleratedNet, mlp, verbose=1).fit(*data)
    out = capsys.readouterr().out
    assert 'train_loss' in out and out.count('\n') >= 4


def test_print_log_sink_parameter_stays_auto(mlp, data):
    net = make_net(AcceleratedNet, mlp)
    net.fit(*data)
    assert net.get_params(deep=False)['callbacks__print_log__sink'] == 'auto'


class OptimizerProbe(Callback):
    def initialize(self):
        self.seen_ = []
        return self

    def on_epoch_end(self, net, **kwargs):
        self.seen_.append(type(net.optimizer_).__name__)


def test_training_unwraps_at_the_end_and_warm_start_rewraps(mlp, data):
    probe = OptimizerProbe()
    net = make_net(AcceleratedNet, mlp, callbacks=[probe])
    net.fit(*data)
    accelerator = net.accelerator
    assert not net._prepared.wrapped
    assert isinstance(net.optimizer_, torch.optim.SGD)
    assert lengths(accelerator) == (0, 0, 0, 0)

    net.set_params(warm_start=True)
    net.fit(*data)
    net.partial_fit(*data)
    assert probe.seen_ == ['AcceleratedOptimizer'] * 6


# --- mixed precision -------------------------------------------------------

def inner_dtypes(net, X):
    """dtypes of the first Linear layer's output during predict_proba."""
    seen = []
    layer = net.accelerator.unwrap_model(net.module_).hidden
    hook = layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        proba = net.predict_proba(X)
    finally:
        hook.remove()
    assert proba.dtype == np.float32
    return set(seen)


@pytest.mark.parametrize('Net', [ours(), incumbent('unwrapping removes the autocast patch for good')])
def test_bf16_survives_save_load_unwrap_and_rewrap(Net, mlp, data, tmp_path):
    accelerator = Accelerator(cpu=True, mixed_precision='bf16')
    net = make_net(Net, mlp, accelerator, unwrap_after_train=False)
    net.fit(*data)
    X = data[0]
    assert inner_dtypes(net, X) == {torch.bfloat16}

    net.save_params(f_params=tmp_path / 'p.pt')
    assert inner_dtypes(net, X) == {torch.bfloat16}
    net.load_params(f_params=tmp_path / 'p.pt')
    assert inner_dtypes(net, X) == {torch.bfloat16}
    net._unwrap_accelerator()
    net._initialize_accelerator()
    assert inner_dtypes(net, X) == {torch.bfloat16}


def test_training_runs_under_autocast(mlp, data):
    seen = set()

    class Hook(Callback):
        def on_train_begin(self, net, **kwargs):
            layer = net.accelerator.unwrap_model(net.module_).hidden
            self.handle_ = layer.register_forward_hook(
                lambda m, i, o: seen.add((m.training, o.dtype)))

        def on_train_end(self, net, **kwargs):
            self.handle_.remove()

    accelerator = Accelerator(cpu=True, mixed_precision='bf16')
    make_net(AcceleratedNet, mlp, accelerator, callbacks=[Hook()]).fit(*data)
    assert seen == {(True, torch.bfloat16), (False, torch.bfloat16)}


def test_unwrapped_net_still_predicts_in_bf16(mlp, data):
    accelerator = Accelerator(cpu=True, mixed_precision='bf16')
    net = make_net(AcceleratedNet, mlp, accelerator)
    net.fit(*data)
    assert not net._prepared.wrapped
    assert inner_dtypes(net, data[0]) == {torch.bfloat16}


# --- saving and loading ----------------------------------------------------

@pytest.mark.parametrize('Net', [ours(), incumbent('every rewrap and predict appends to the lists')])
def test_accelerator_lists_do_not_grow(Net, mlp, data, tmp_path):
    net = make_net(Net, mlp, unwrap_after_train=False)
    net.fit(*data)
    before = lengths(net.accelerator)
    for _ in range(5):
        net.save_params(f_params=tmp_path / 'p.pt')
        net.load_params(f_params=tmp_path / 'p.pt')
        net.predict(data[0])
    net.partial_fit(*data)
    net.fit(*data)
    assert lengths(net.accelerator) == before


def test_load_with_device_none_maps_to_cpu_silently(mlp, data, tmp_path):
    trained = make_net(AcceleratedNet, mlp)
    trained.fit(*data)
    trained.save_params(f_params=tmp_path / 'p.pt', f_optimizer=tmp_path / 'o.pt')
    fresh = make_net(AcceleratedNet, mlp).initialize()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        fresh.load_params(f_params=tmp_path / 'p.pt', f_optimizer=tmp_path / 'o.pt')
    assert fresh.device is None
    np.testing.assert_array_equal(fresh.predict_proba(data[0]), trained.predict_proba(data[0]))


def test_save_failure_raises_the_original_error(mlp, data, tmp_path):
    net = make_net(AcceleratedNet, mlp, unwrap_after_train=False)
    net.fit(*data)
    with pytest.raises((RuntimeError, OSError), match='missing'):
        net.save_params(f_params=tmp_path / 'missing' / 'p.pt')
    assert net._prepared.wrapped  # rewrapped despite the error


def test_load_params_with_checkpoint_initializes_first(mlp, data, tmp_path):
    from skorch.callbacks import Checkpoint

    checkpoint = Checkpoint(dirname=str(tmp_path), monitor=None)
    trained = make_net(AcceleratedNet, mlp, callbacks=[checkpoint])
    trained.fit(*data)
    fresh = make_net(AcceleratedNet, mlp)
    fresh.load_params(checkpoint=checkpoint)
    np.testing.assert_array_equal(fresh.predict_proba(data[0]), trained.predict_proba(data[0]))
    assert fresh._prepared.wrapped


# --- copies ----------------------------------------------------------------

@pytest.mark.parametrize('Net', [ours(), incumbent('the pickled accelerator carries every dataloader')])
def test_pickle_does_not_grow_with_predict_calls(Net, mlp, data):
    net = make_net(Net, mlp)
    net.fit(*data)
    net.predict(data[0])
    size = len(pickle.dumps(net))
    for _ in range(20):
        net.predict(data[0])
    assert len(pickle.dumps(net)) == size


def test_pickle_round_trip_predicts_the_same(mlp, data):
    net = make_net(AcceleratedNet, mlp, accelerator=Accelerator(cpu=True, mixed_precision='bf16'))
    net.fit(*data)
    restored = pickle.loads(pickle.dumps(net))
    assert restored.accelerator.mixed_precision == 'bf16'
    np.testing.assert_array_equal(restored.predict_proba(data[0]), net.predict_proba(data[0]))
    restored.partial_fit(*data)  # and trains on


def test_pickle_of_a_wrapped_net(mlp, data):
    net = make_net(AcceleratedNet, mlp, unwrap_after_train=False,
                   accelerator=Accelerator(cpu=True, mixed_precision='bf16'))
    net.fit(*data)
    restored = pickle.loads(pickle.dumps(net))
    assert net._prepared.wrapped
    np.testing.assert_array_equal(restored.predict_proba(data[0]), net.predict_proba(data[0]))


@pytest.mark.parametrize('Net', [ours(), incumbent('its flag _wrapped_with_accelerator breaks clone')])
def test_deepcopy_and_clone_share_the_accelerator(Net, mlp, data):
    from sklearn.base import clone

    net = make_net(Net, mlp, unwrap_after_train=False)
    net.fit(*data)
    copied = copy.deepcopy(net)
    assert copied.accelerator is net.accelerator
    assert copied.module_ is not net.module_
    np.testing.assert_array_equal(copied.predict_proba(data[0]), net.predict_proba(data[0]))

    cloned = clone(net)
    assert cloned.accelerator is net.accelerator
    assert not hasattr(cloned, 'module_')
    cloned.fit(*data)
    assert cloned.predict(data[0]).shape == (len(data[0]),)


def test_trimmed_net_stays_trimmed(mlp, data, tmp_path):
    net = make_net(AcceleratedNet, mlp, unwrap_after_train=False)
    net.fit(*data)
    expected = net.predict_proba(data[0])
    net.trim_for_prediction()
    net.save_params(f_params=tmp_path / 'p.pt')
    restored = pickle.loads(pickle.dumps(net))
    assert net.optimizer_ is None and net.criterion_ is None
    assert net.accelerator._optimizers == []
    np.testing.assert_array_equal(restored.predict_proba(data[0]), expected)


def test_compiled_bf16_net_pickles_and_copies(mlp, data):
    net = make_net(AcceleratedNet, mlp, compile=True, compile__backend='eager',
                   accelerator=Accelerator(cpu=True, mixed_precision='bf16'))
    net.fit(*data)
    expected = net.predict_proba(data[0])
    for copied in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        np.testing.assert_array_equal(copied.predict_proba(data[0]), expected)


def test_grid_search(mlp, data):
    from sklearn.model_selection import GridSearchCV

    net = make_net(AcceleratedNet, mlp, max_epochs=1, train_split=None)
    search = GridSearchCV(net, {'lr': [0.05, 0.1]}, cv=2, scoring='accuracy', refit=True)
    search.fit(*data)
    assert search.best_estimator_.predict(data[0]).shape == (len(data[0]),)
    assert lengths(net.accelerator) == (0, 0, 0, 0)


def test_distributed_history_is_refused_with_the_migration(mlp):
    import torch.distributed as dist
    from skorch.history import DistributedHistory

    history = DistributedHistory(store=dist.HashStore(), rank=0, world_size=1)
    net = AcceleratedNet(mlp, accelerator=Accelerator(cpu=True), history=history)
    with pytest.raises(ValueError, match=r"remove history=DistributedHistory\(\.\.\.\) .*"
                                         "Migrating from skorch.hf"):
        net.initialize()
