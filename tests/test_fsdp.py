"""FSDP2 through accelerate, on 2 and 3 real CPU processes (gloo): the
module and its optimizers prepared together, training equal to DDP and to
one process with N x the batch, full files both ways, and the refusals.

accelerate selects FSDP for GPU kinds only; the launched script sets it on
CPU with the test-only ``make_fsdp_accelerator`` (``launched/common.py``).
"""

import re

import pytest
from harness import CheckedRanks, run_processes
from harness import check_errors as errors
from harness import check_values as values

pytestmark = pytest.mark.multiprocess

# float32 sums in another order (reduce-scatter, all-reduce, one batch)
CLOSE = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=["2-processes", "3-processes"])
def fsdp(request):
    # read in each test: a launch that crashed fails every test reading it
    return CheckedRanks(run_processes("fsdp_checks.py", nproc=request.param, timeout=300))


def test_fsdp2_trains_as_ddp_and_as_one_process_with_n_times_the_batch(fsdp):
    for value in values(fsdp, "fsdp_trains_as_ddp_and_one_process"):
        assert value["parameter_types"] == ["DTensor"]  # the optimizer steps shards
        assert value["vs_ddp"] < CLOSE
        assert value["vs_one_process"] < CLOSE
        assert value["moved"] > 0.05  # it trained
        for row, plain in zip(value["history"], value["history_one_process"]):
            assert row == pytest.approx(plain, abs=CLOSE)
        assert value["models_listed"] == 0  # unwrapped after training


def test_a_transformer_from_config_trains_as_ddp_and_one_process(fsdp):
    for value in values(fsdp, "a_transformer_trains_as_ddp_and_one_process"):
        assert value["sharded_units"] == 3  # each BertLayer and the root
        assert value["vs_ddp"] < CLOSE
        assert value["vs_one_process"] < CLOSE
        assert value["moved"] > 0.05
        assert value["reloaded"] == 0.0  # save_params' full file, into plain skorch


def test_gradient_clipping_is_global_and_accumulation_works(fsdp):
    for value in values(fsdp, "clipping_and_accumulation_as_ddp"):
        # GradientNormClipping over DTensors clips by the norm of every shard together
        assert value["clipped"] < CLOSE
        assert value["clipping_changed_training"] > 0.01
        assert value["accumulated"] < CLOSE


def test_train_step_overrides_callbacks_and_learnable_params_as_under_ddp(fsdp):
    for value in values(fsdp, "overrides_and_callbacks_as_ddp"):
        assert value["steps"][0] == value["steps"][1] > 0
        assert value["batches"][0] == value["batches"][1] > value["steps"][0]
        assert value["bias_untrained"]
        assert value["vs_ddp"] < CLOSE


def test_freezer_and_a_new_optimizer_train_as_under_ddp(fsdp):
    for value in values(fsdp, "freezing_and_a_new_optimizer_as_ddp"):
        assert value["hidden_moved"] == 0.0  # frozen from the first epoch
        assert value["moved"] > 0.01
        assert value["vs_ddp"] < CLOSE
        # the new Adam steps the shards, each once, as many steps as DDP's
        assert value["adam_steps"][0] == value["adam_steps"][1] != []
        assert value["held"][0] == value["held"][1] == [4]
        assert value["distinct"] == 4


def test_mixed_precision_is_fsdps_policy_with_float32_predictions(fsdp):
    for value in values(fsdp, "bf16_is_fsdps_policy"):
        assert value["computed_in"] == ["torch.bfloat16"]
        assert value["master_weights"] == ["torch.float32"]
        assert value["predicted"] == "float32"
        assert value["losses"][-1] < value["losses"][0]


def test_save_params_writes_full_files_that_plain_skorch_loads(fsdp):
    for value in values(fsdp, "save_params_loads_into_plain_skorch"):
        assert value["keys"] == value["plain_keys"]  # no wrapper prefix
        assert value["predictions"] < 1e-6
        assert value["history_rows"] == 3
        assert value["optimizer_groups"] == 1


def test_full_files_load_into_a_sharded_net_with_the_optimizer_state(fsdp):
    for value in values(fsdp, "full_files_load_into_a_sharded_net"):
        assert value["predictions"] < 1e-6
        assert value["weights"] == 0.0
        assert value["moments"] == 0.0
        # Adam's state came back whole: one more epoch each stays equal
        assert value["after_one_more_epoch"] < CLOSE
        # numbered by position, as optimizer.state_dict() numbers it
        assert value["optimizer_file_keys"] == [0, 1, 2, 3]
        assert value["optimizer_file_groups"] == [[0, 1, 2, 3]]
        # and the optimizer file loads into a plain Adam on one process
        assert value["plain_steps"] == [value["plain_steps"][0]] * 4
        assert value["plain_steps"][0] > 0


def test_rewrapping_after_training_shards_nothing_again(fsdp):
    for value in values(fsdp, "rewrapping_shards_nothing_again"):
        assert value["prepare_calls"] == 0
        assert value["same_module"] and value["same_optimizer"]
        assert value["epochs"] == 6


def test_refitting_frees_the_replaced_module_at_once(fsdp):
    # a sharded module is in a reference cycle with its FSDP2 state: held
    # until a full collection, the replaced one's shards and gradients
    # stayed resident through the next fit
    for value in values(fsdp, "refitting_frees_the_replaced_module"):
        assert value["new_module"]
        assert not value["replaced_module_alive"] and not value["replaced_shard_alive"]


REFUSED = {
    "second_module": "module module2_ .*shards one module, module_.*Move its parameters",
    "criterion": "criterion criterion_ \\(ParamNLLLoss\\) has 1 parameter",
    "fsdp1": "does not support FSDP1 .*fsdp_version=2",
    "pickle": "TypeError: A net whose module_ is sharded by FSDP2 cannot be pickled",
    "stray_optimizer": "optimizer optimizer_ holds 1 tensor\\(s\\) that are not shards of module_",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_fsdp2_cannot_do_is_refused_naming_it(fsdp, case):
    for value in values(fsdp, "refusals"):
        assert value[case] is not None and re.search(REFUSED[case], value[case]), value[case]
        assert value["predicts"] == 250


def test_skorchs_checkpoint_and_early_stopping_restore_the_best_weights(fsdp):
    for value in values(fsdp, "skorchs_checkpoint_and_early_stopping"):
        assert value["checkpoint_epochs"][-1] == value["best_epoch"]
        # the weights in place after fit are those of the best epoch's file
        assert value["loaded_best"] == 0.0


# --- FSDP asked for where accelerate does not select it ----------------------


@pytest.mark.parametrize("route", ["plugin", "env"])
def test_fsdp_asked_for_on_cpu_is_refused_naming_why(route):
    """On CPU accelerate selects DDP whatever the plugin says; skorch.hf then
    trains unsharded silently, ours refuses at initialize."""
    env = {"ACCELERATE_USE_FSDP": "true"} if route == "env" else None
    launch = run_processes("fsdp_asked.py", route, env=env, timeout=300).check()
    for value in values(launch, "incumbent"):
        assert value["distributed_type"] == "DistributedType.MULTI_CPU"
    for error in errors(launch, "ours"):
        # each rank refuses; a rank that learns of another's refusal first
        # raises it as that rank's
        assert re.match(
            r"(DistributedError: fit failed on rank \d: )?ValueError: FSDP was asked", error
        )
        assert "distributed_type=DistributedType.MULTI_CPU on 2 process(es)" in error
        assert "without fsdp_plugin" in error and "Launch it on GPUs" in error
