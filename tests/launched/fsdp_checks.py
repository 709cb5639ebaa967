"""FSDP2 under N real processes: the same training as DDP and as one process
with N x the batch, full files that plain skorch loads, full files loaded
into a sharded net, and the refusals; each scenario a check of its own.

Every fit starts from a fresh accelerator state (``fresh_state``), FSDP2 set
on it by the test-only ``make_fsdp_accelerator``.
"""

import gc
import os
import pickle
import weakref
from pathlib import Path

import torch
from common import (
    MLP,
    AcceleratedNet,
    Checks,
    ParamNLLLoss,
    TwoStageNet,
    fresh_state,
    make_accelerator,
    make_data,
    make_fsdp_accelerator,
    outcome,
    report,
)
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback, Checkpoint, EarlyStopping, Freezer, GradientNormClipping

OUT = Path(os.environ.get("ACCEL_RESULTS_DIR", "."))
BATCH = 16
EPOCHS = 3
# 250 samples, 200 to train: the last global batch is partial on 2 and 3 processes
X, y = make_data(n=250)
checks = Checks(deadline=180)


def full(tensor):
    """The whole tensor on every rank (a collective for a shard)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def flat_weights(net):
    return torch.cat([full(p).flatten() for p in net.module_.parameters()])


def accelerated(
    kind, net_class=AcceleratedNet, accumulation=1, precision=None, plugin=None, **kwargs
):
    fresh_state()
    options = {"gradient_accumulation_steps": accumulation}
    if precision:
        options["mixed_precision"] = precision
    if kind == "fsdp":
        accelerator = make_fsdp_accelerator(plugin=plugin, **options)
    else:
        accelerator = make_accelerator(**options)
    torch.manual_seed(0)
    params = dict(module=MLP, max_epochs=EPOCHS, lr=0.1, batch_size=BATCH, verbose=0)
    params.update(kwargs)
    return net_class(accelerator=accelerator, **params)


def one_process(**kwargs):
    """Plain skorch with the global batch, on this rank alone."""
    torch.manual_seed(0)
    n = int(os.environ["WORLD_SIZE"])
    params = dict(module=MLP, max_epochs=EPOCHS, lr=0.1, batch_size=BATCH * n, verbose=0)
    params.update(kwargs)
    return NeuralNetClassifier(**params)


def sharded_params(net):
    """The parameters the optimizer steps: the shards, whether or not the
    module's root holds its gathered parameters after a forward pass."""
    return [p for group in net.optimizer_.param_groups for p in group["params"]]


def max_diff(a, b):
    return float((a - b).abs().max())


def history_of(net):
    return [[row["train_loss"], row["valid_loss"], row["valid_acc"]] for row in net.history]


@checks
def fsdp_trains_as_ddp_and_one_process():
    fsdp = accelerated("fsdp").fit(X, y)
    kinds = sorted({type(p.data).__name__ for p in sharded_params(fsdp)})
    sharded = flat_weights(fsdp)
    ddp = accelerated("ddp").fit(X, y)
    plain = one_process().fit(X, y)
    moved = max_diff(sharded, flat_weights(one_process().initialize()))
    return {
        "parameter_types": kinds,
        "vs_ddp": max_diff(sharded, flat_weights(ddp)),
        "vs_one_process": max_diff(sharded, flat_weights(plain)),
        "moved": moved,
        "history": history_of(fsdp),
        "history_one_process": history_of(plain),
        "models_listed": len(fsdp.accelerator._models),  # pylint: disable=protected-access
    }


@checks
def clipping_and_accumulation_as_ddp():
    out = {}
    for name, options in (
        ("clipped", {"callbacks": [GradientNormClipping(gradient_clip_value=0.05)]}),
        ("accumulated", {"accumulation": 2, "batch_size": BATCH // 2}),
    ):
        sharded = flat_weights(accelerated("fsdp", **options).fit(X, y))
        ddp = flat_weights(accelerated("ddp", **options).fit(X, y))
        out[name] = max_diff(sharded, ddp)
    clipped = flat_weights(accelerated("fsdp", callbacks=[GradientNormClipping(0.05)]).fit(X, y))
    out["clipping_changed_training"] = max_diff(
        clipped, flat_weights(accelerated("fsdp").fit(X, y))
    )
    return out


class CountingNet(AcceleratedNet):
    """A user's overrides on the class below the mixin: train_step counts,
    and the output layer's bias is left out of the optimizer."""

    def train_step(self, batch, **fit_params):
        self.steps_ = getattr(self, "steps_", 0) + 1
        return super().train_step(batch, **fit_params)

    def get_all_learnable_params(self):
        for name, param in super().get_all_learnable_params():
            if name != "out.bias":
                yield name, param


class Batches(Callback):
    def initialize(self):
        self.count_ = 0
        return self

    def on_batch_end(self, net, **kwargs):
        self.count_ += 1


@checks
def overrides_and_callbacks_as_ddp():
    out = {}
    for kind in ("fsdp", "ddp"):
        net = accelerated(kind, net_class=CountingNet, callbacks=[Batches()]).fit(X, y)
        out[kind] = {
            "steps": net.steps_,
            "batches": dict(net.callbacks_)["Batches"].count_,
            "bias": full(net.module_.out.bias).tolist(),
            "weights": flat_weights(net),
        }
    return {
        "steps": [out["fsdp"]["steps"], out["ddp"]["steps"]],
        "batches": [out["fsdp"]["batches"], out["ddp"]["batches"]],
        "bias_untrained": out["fsdp"]["bias"] == out["ddp"]["bias"],
        "vs_ddp": max_diff(out["fsdp"]["weights"], out["ddp"]["weights"]),
    }


@checks
def freezing_and_a_new_optimizer_as_ddp():
    """Freezer at every epoch's begin, then another optimizer, which skorch
    builds anew on the module's parameters (its shards, not the gathered ones
    a forward pass leaves in the root)."""
    out = {}
    start = one_process().initialize().module_.hidden.weight.detach().clone()  # seed 0 alike
    for kind in ("fsdp", "ddp"):
        net = accelerated(kind, callbacks=[Freezer("hidden.*")]).fit(X, y)
        net.optimizer, net.lr = torch.optim.Adam, 0.01
        net.initialize_optimizer()
        net.partial_fit(X, y)
        out[kind] = {
            "weights": flat_weights(net),
            "hidden_moved": max_diff(full(net.module_.hidden.weight), start),
            "adam_steps": sorted(
                {float(s["step"]) for s in net.optimizer_.state.values() if "step" in s}
            ),
            "held": [len(group["params"]) for group in net.optimizer_.param_groups],
            "distinct": len({id(p) for p in sharded_params(net)}),
        }
    return {
        "vs_ddp": max_diff(out["fsdp"]["weights"], out["ddp"]["weights"]),
        "hidden_moved": out["fsdp"]["hidden_moved"],
        "adam_steps": [out["fsdp"]["adam_steps"], out["ddp"]["adam_steps"]],
        "held": [out["fsdp"]["held"], out["ddp"]["held"]],
        "distinct": out["fsdp"]["distinct"],
        "moved": max_diff(out["fsdp"]["weights"], flat_weights(one_process().initialize())),
    }


class Dtypes(Callback):
    """The dtype the module's output layer computes in."""

    def initialize(self):
        self.seen_ = set()
        return self

    def on_train_begin(self, net, **kwargs):
        def hook(module, args, output):
            self.seen_.add(str(output.dtype))

        net.module_.out.register_forward_hook(hook)


@checks
def bf16_is_fsdps_policy():
    net = accelerated("fsdp", precision="bf16", callbacks=[Dtypes()]).fit(X, y)
    proba = net.predict_proba(X)
    return {
        "computed_in": sorted(dict(net.callbacks_)["Dtypes"].seen_),
        "predicted": str(proba.dtype),
        # the optimizer's shards; the module's root holds the low precision
        # parameters it gathered for the last forward pass
        "master_weights": sorted({str(p.dtype) for p in sharded_params(net)}),
        "losses": [row["train_loss"] for row in net.history],
    }


@checks
def save_params_loads_into_plain_skorch():
    net = accelerated("fsdp").fit(X, y)
    files = {key: str(OUT / f"fsdp_{key}.pt") for key in ("f_params", "f_optimizer", "f_history")}
    net.save_params(**files)
    expected = net.predict_proba(X)
    plain = one_process(optimizer=torch.optim.SGD).initialize()
    plain.load_params(**files)
    keys = sorted(torch.load(files["f_params"], weights_only=True))
    return {
        "keys": keys,
        "plain_keys": sorted(plain.module_.state_dict()),
        "predictions": max_diff(torch.as_tensor(plain.predict_proba(X)), torch.as_tensor(expected)),
        "history_rows": len(plain.history),
        "optimizer_groups": len(plain.optimizer_.state_dict()["param_groups"]),
        "optimizer_states": len(plain.optimizer_.state_dict()["state"]),
    }


@checks
def full_files_load_into_a_sharded_net():
    # Adam, so that the optimizer's state holds tensors shaped as the parameters
    original = accelerated("fsdp", optimizer=torch.optim.Adam, lr=0.01).fit(X, y)
    files = {key: str(OUT / f"adam_{key}.pt") for key in ("f_params", "f_optimizer", "f_history")}
    original.save_params(**files)
    expected = original.predict_proba(X)
    loaded = accelerated("fsdp", optimizer=torch.optim.Adam, lr=0.01)
    torch.manual_seed(1)  # other initial weights, which the load replaces
    loaded.initialize()
    loaded.load_params(**files)
    predictions = max_diff(torch.as_tensor(loaded.predict_proba(X)), torch.as_tensor(expected))
    weights = max_diff(flat_weights(loaded), flat_weights(original))
    moments = max(
        max_diff(
            full(loaded.optimizer_.state[a]["exp_avg_sq"]),
            full(original.optimizer_.state[b]["exp_avg_sq"]),
        )
        for a, b in zip(sharded_params(loaded), sharded_params(original))
    )
    # one more epoch each: equal if the optimizer's state came back whole
    original.partial_fit(X, y)
    loaded.partial_fit(X, y)
    plain = one_process(optimizer=torch.optim.Adam, lr=0.01).initialize()
    plain.load_params(f_optimizer=files["f_optimizer"], f_params=files["f_params"])
    saved = torch.load(files["f_optimizer"], weights_only=True)
    return {
        "predictions": predictions,
        "weights": weights,
        "moments": moments,
        "after_one_more_epoch": max_diff(flat_weights(loaded), flat_weights(original)),
        "plain_steps": [float(s["step"]) for s in plain.optimizer_.state.values()],
        "optimizer_file_keys": sorted(saved["state"]),
        "optimizer_file_groups": [group["params"] for group in saved["param_groups"]],
    }


@checks
def rewrapping_shards_nothing_again():
    net = accelerated("fsdp").fit(X, y)  # unwrapped after training
    module, optimizer = net.module_, net.optimizer_
    calls = []
    prepare = net.accelerator.prepare
    net.accelerator.prepare = lambda *a, **k: calls.append(len(a)) or prepare(*a, **k)
    net.partial_fit(X, y)
    net.predict(X)
    return {
        "prepare_calls": len(calls),
        "same_module": net.module_ is module,
        "same_optimizer": net.optimizer_ is optimizer,
        "models_listed": len(net.accelerator._models),  # pylint: disable=protected-access
        "epochs": len(net.history),
    }


@checks
def refitting_frees_the_replaced_module():
    net = accelerated("fsdp", max_epochs=1).fit(X, y)
    replaced = weakref.ref(net.module_)
    shard = weakref.ref(sharded_params(net)[0])
    # the interpreter's own collections would free it at some later time
    gc.disable()
    try:
        net.fit(X, y)  # skorch builds and shards a new module
        return {
            "replaced_module_alive": replaced() is not None,
            "replaced_shard_alive": shard() is not None,
            "new_module": net.module_ is not replaced(),
        }
    finally:
        gc.enable()


@checks
def skorchs_checkpoint_and_early_stopping():
    """Checkpoint (save_params on every improvement, loaded at the end) and
    EarlyStopping(load_best=True), which copies the module's state dict."""
    dirname = str(OUT / "skorch_checkpoint")
    net = accelerated(
        "fsdp",
        max_epochs=6,
        lr=0.5,
        callbacks=[
            Checkpoint(monitor="valid_loss_best", dirname=dirname, load_best=True),
            EarlyStopping(monitor="valid_loss", patience=2, load_best=True),
        ],
    ).fit(X, y)
    best = min(range(len(net.history)), key=lambda i: net.history[i, "valid_loss"])
    plain = one_process().initialize()
    plain.load_params(f_params=str(Path(dirname) / "params.pt"))
    return {
        "epochs": len(net.history),
        "best_epoch": best + 1,
        "checkpoint_epochs": [row["epoch"] for row in net.history if row["event_cp"]],
        "loaded_best": max_diff(flat_weights(net), flat_weights(plain)),
    }


class TinyBert(torch.nn.Module):
    """A 2-layer BERT from its config (nothing downloaded), without dropout,
    so that every layout draws nothing; returns logits."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=2,
        )
        self.bert = BertForSequenceClassification(config)

    def forward(self, X):
        return self.bert(input_ids=X).logits


@checks
def a_transformer_trains_as_ddp_and_one_process():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (250, 12), generator=generator)
    labels = (tokens == 7).any(dim=1).long()
    data = tokens.numpy(), labels.numpy()
    # every BertLayer a sharded unit of its own, inside the sharded root
    plugin = {
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": ["BertLayer"],
    }
    options = dict(module=TinyBert, criterion=torch.nn.CrossEntropyLoss, lr=0.05, max_epochs=2)
    sharded = accelerated("fsdp", plugin=plugin, **options).fit(*data)
    units = sum(type(m).__name__.startswith("FSDP") for m in sharded.module_.modules())
    weights = flat_weights(sharded)
    files = {"f_params": str(OUT / "bert.pt")}
    sharded.save_params(**files)
    ddp = flat_weights(accelerated("ddp", **options).fit(*data))
    plain = one_process(**options).fit(*data)
    reloaded = one_process(**options).initialize()
    reloaded.load_params(**files)
    return {
        "sharded_units": units,
        "vs_ddp": max_diff(weights, ddp),
        "vs_one_process": max_diff(weights, flat_weights(plain)),
        "reloaded": max_diff(weights, flat_weights(reloaded)),
        "moved": max_diff(weights, flat_weights(one_process(**options).initialize())),
    }


@checks
def refusals():
    out = {
        "second_module": outcome(lambda: accelerated("fsdp", net_class=TwoStageNet).initialize()),
        "criterion": outcome(lambda: accelerated("fsdp", criterion=ParamNLLLoss).initialize()),
    }
    fresh_state()
    fsdp1 = make_fsdp_accelerator(fsdp_version=1)
    out["fsdp1"] = outcome(lambda: AcceleratedNet(MLP, accelerator=fsdp1).initialize())
    net = accelerated("fsdp", max_epochs=1).fit(X, y)
    out["pickle"] = outcome(lambda: pickle.dumps(net))
    stray = torch.nn.Parameter(torch.zeros(3))
    net.optimizer_ = torch.optim.SGD([stray], lr=0.1)  # not built on the net's parameters
    out["stray_optimizer"] = outcome(lambda: net.partial_fit(X, y))
    net.initialize_optimizer()
    # the net still works after every refusal
    out["predicts"] = len(net.predict(X))
    return out


report({"checks": checks.results, "world_size": int(os.environ["WORLD_SIZE"])})
