"""HSDP: FSDP2 on a 2 x 2 mesh (``ParallelismConfig(dp_replicate_size=2,
dp_shard_size=2)``), on 4 real processes (``launched/hsdp_run.py``).

The mesh is set on the accelerator's state as accelerate sets it on GPUs
(``common.make_hsdp_accelerator``): on CPU accelerate refuses a
``ParallelismConfig`` of several processes itself. HSDP trains as DDP does
on the same 4 processes, with and without gradient accumulation; its
training state resumes exactly under HSDP and reshards into FSDP2 across
all 4, DDP and one process; its ``save_params`` files are whole.
"""

import pytest
from harness import check_values, run_plain, run_processes

FP32 = 1e-5  # the bound; measured: at most 6e-8


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    dirname = tmp_path_factory.mktemp("hsdp")
    ranks = run_processes("hsdp_run.py", dirname, nproc=4, timeout=600).check()
    alone = run_plain("hsdp_run.py", "load", dirname, timeout=300).check()[0]
    return ranks, alone


@pytest.mark.multiprocess
def test_hsdp_shards_on_the_two_dimensional_mesh(launched):
    for rank in check_values(launched[0], "mesh"):
        assert rank == {"mesh": [2, 2], "placements": ["R", "S(0)"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("check", ["equal_to_ddp", "accumulated_equal_to_ddp"])
def test_hsdp_trains_as_ddp_does(launched, check):
    for rank in check_values(launched[0], check):
        furthest = rank if check == "accumulated_equal_to_ddp" else rank["furthest"]
        assert furthest <= FP32
        if check == "equal_to_ddp":
            assert rank["loss"] == pytest.approx(rank["ddp_loss"], abs=FP32)


@pytest.mark.multiprocess
def test_an_hsdp_state_resumes_exactly_under_hsdp(launched):
    check_values(launched[0], "state_saved")
    for rank in check_values(launched[0], "resumed_hsdp"):
        assert rank == {"furthest": 0.0, "epochs": 2}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_an_hsdp_state_reshards_into_other_layouts(launched, layout):
    for rank in check_values(launched[0], f"resumed_{layout}"):
        assert rank["epochs"] == 2
        assert rank["furthest"] <= FP32


@pytest.mark.multiprocess
def test_an_hsdp_state_loads_on_one_process(launched):
    assert launched[1] == {"furthest": 0.0, "epochs": 1}


@pytest.mark.multiprocess
def test_hsdp_params_files_are_whole_and_load_in_every_layout(launched):
    for rank in check_values(launched[0], "params_files"):
        assert rank == {"ddp": 0.0, "hsdp": 0.0}
