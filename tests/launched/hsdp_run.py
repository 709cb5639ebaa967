"""HSDP on 4 processes: FSDP2 on a 2 x 2 mesh (two replica groups, each
sharding the model across its 2 ranks), against DDP on the same 4, and its
training state loaded into other layouts.

Usage: torchrun --nproc_per_node 4 hsdp_run.py DIRNAME
       python hsdp_run.py load DIRNAME   (one process: the HSDP state)
"""

import sys

import numpy as np
from common import (
    Checks,
    make_accelerator,
    make_data,
    make_fsdp_accelerator,
    make_hsdp_accelerator,
    report,
    seeded_net,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

X, y = make_data(256)


def new_net(accelerator, max_epochs=2):
    return seeded_net(max_epochs, accelerator=accelerator, train_split=None)


def full_weights(net):
    """The whole weights, on every rank, whatever the layout."""
    module = net.accelerator.unwrap_model(net.module_)
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {key: value.detach().cpu().numpy() for key, value in sorted(state.items())}


def furthest(a, b):
    return max(float(np.abs(a[key] - b[key]).max()) for key in a)


def hsdp(**kwargs):
    return make_hsdp_accelerator(replicate=2, shard=2, **kwargs)


if sys.argv[1] == "load":
    net = new_net(make_accelerator).initialize()
    net.load_state(f"{sys.argv[2]}/hsdp-state")
    saved = np.load(f"{sys.argv[2]}/hsdp-state.npz")
    report({"furthest": furthest(full_weights(net), dict(saved)), "epochs": len(net.history)})
    sys.exit()

DIRNAME = sys.argv[1]
checks = Checks(deadline=300)
trained = {}


@checks
def mesh():
    net = new_net(hsdp).initialize()
    param = next(net.accelerator.unwrap_model(net.module_).parameters())
    return {"mesh": list(param.device_mesh.shape), "placements": [str(p) for p in param.placements]}


@checks
def equal_to_ddp():
    ddp = new_net(make_accelerator).fit(X, y)
    sharded = new_net(hsdp).fit(X, y)
    trained["ddp"], trained["hsdp"] = full_weights(ddp), full_weights(sharded)
    return {
        "furthest": furthest(trained["hsdp"], trained["ddp"]),
        "loss": [row["train_loss"] for row in sharded.history],
        "ddp_loss": [row["train_loss"] for row in ddp.history],
    }


@checks
def state_saved():
    net = new_net(hsdp, max_epochs=1).fit(X, y)
    net.save_state(f"{DIRNAME}/hsdp-state")
    if net.accelerator.is_main_process:
        np.savez(f"{DIRNAME}/hsdp-state.npz", **full_weights(net))
    else:
        full_weights(net)  # a collective
    net.wait_for_everyone()
    return True


@checks
def accumulated_equal_to_ddp():
    def accumulating(make):
        return lambda: make(gradient_accumulation_steps=2)

    ddp = new_net(accumulating(make_accelerator)).fit(X, y)
    sharded = new_net(accumulating(hsdp)).fit(X, y)
    return furthest(full_weights(sharded), full_weights(ddp))


@checks
def params_files():
    """save_params gathers the whole weights; they load into DDP and HSDP."""
    net = new_net(hsdp, max_epochs=1).fit(X, y)
    files = {"f_params": f"{DIRNAME}/hsdp-params.pt", "f_optimizer": f"{DIRNAME}/hsdp-opt.pt"}
    net.save_params(**files)
    out = {}
    for layout, accelerator in (("ddp", make_accelerator), ("hsdp", hsdp)):
        loaded = new_net(accelerator).initialize()
        loaded.load_params(**files)
        out[layout] = furthest(full_weights(loaded), full_weights(net))
    return out


LAYOUTS = {"hsdp": hsdp, "fsdp2": make_fsdp_accelerator, "ddp": make_accelerator}
for layout, accelerator in LAYOUTS.items():

    def resumed(accelerator=accelerator):
        net = new_net(accelerator)
        net.load_state(f"{DIRNAME}/hsdp-state")
        net.fit(X, y)
        return {
            "furthest": furthest(full_weights(net), trained["hsdp"]),
            "epochs": len(net.history),
        }

    checks.run(resumed, f"resumed_{layout}")

report(checks.results)
