"""The benchmarks run, at tiny sizes; they measure, they do not assert times."""

import json
import subprocess
import sys

import pytest
from harness import ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.bench]


def test_benchmarks_run_and_report(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- bench:start -->\nold\n<!-- bench:end -->\nafter\n")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmarks" / "run.py"),
            "--quick",
            "--out",
            str(tmp_path / "results"),
            "--readme",
            str(readme),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr

    results = tmp_path / "results"
    fit_1 = json.loads((results / "raw" / "fit_1.json").read_text())
    assert set(fit_1["results"]) == {
        "skorch",
        "accel_mixin",
        "incumbent",
        "accelerate loop",
        "accel_mixin, notices polled",
        "accel_mixin, signals=()",
    }
    assert fit_1["results"]["skorch"]["ratio"] == 1.0
    assert all(len(row["runs_s"]) == 2 for row in fit_1["results"].values())
    fit_2 = json.loads((results / "raw" / "fit_2.json").read_text())
    assert fit_2["processes"] == 2 and "skorch" not in fit_2["results"]
    assert "accel_mixin, no history sync" in fit_2["results"]
    assert "accel_mixin, signals=()" in fit_2["results"]
    assert "accel_mixin, notices polled every batch" in fit_2["results"]
    assert "accel_mixin, padding trains" in fit_2["results"]
    lightning = json.loads((results / "raw" / "lightning_2.json").read_text())
    assert lightning["processes"] == 2
    assert set(lightning["results"]) == {"with validation", "without validation"}
    for res in lightning["results"].values():
        assert set(res) == {"accel_mixin", "lightning", "accelerate loop"}
        assert all(len(row["runs_s"]) == 2 for row in res.values())
    resume = json.loads((results / "raw" / "lightning_resume_2.json").read_text())
    assert set(resume["stall_s"]) == {
        "accel_mixin",
        "lightning",
        "accel_mixin async",
        "lightning async",
    }
    assert all(len(runs) == 2 and min(runs) > 0 for runs in resume["stall_s"].values())
    points = {
        f"{who} | {point}"
        for who in ("accel_mixin", "lightning")
        for point in ("epoch end", "mid-epoch")
    }
    assert set(resume["restart_s"]) == points and set(resume["exact"]) == points
    # measured, not assumed: both frameworks repeat a run resumed at an epoch's end
    assert resume["exact"]["accel_mixin | epoch end"]["largest_difference"] == 0
    assert resume["exact"]["lightning | epoch end"]["largest_difference"] == 0
    assert resume["exact"]["accel_mixin | mid-epoch"]["largest_difference"] == 0
    assert "-batch-" in resume["exact"]["accel_mixin | mid-epoch"]["from"]
    other = json.loads((results / "raw" / "lightning_resume_1.json").read_text())
    assert other["processes"] == 1 and other["saved_by"] == 2 and set(other["exact"]) == points
    checkpoint = json.loads((results / "raw" / "checkpoint_2.json").read_text())
    assert set(checkpoint["save"]) == {
        "torch.save",
        "torch.save + fsync",
        "accel_mixin",
        "incumbent",
        "torch.save, overwriting",
        "accel_mixin, overwriting",
    }
    assert set(checkpoint["rewrap"]) == {"small", "large"}
    assert set(checkpoint["load_memory_over_file_size"]) == {
        "torch.load",
        "accel_mixin",
        "incumbent",
    }

    for name, kind in (("stall_2", "ddp"), ("stall_fsdp_2", "fsdp")):
        stall = json.loads((results / "raw" / f"{name}.json").read_text())
        assert stall["kind"] == kind
        assert set(stall["stall_s"]) == {
            "synchronous",
            "asynchronous",
            "asynchronous, a new CPU copy per save",
        }
    small = json.loads((results / "raw" / "checkpoint_small_2.json").read_text())
    assert small["params"] < checkpoint["params"] and "torch.save + fsync" in small["save"]
    replicas = json.loads((results / "raw" / "replicas_2.json").read_text())
    assert set(replicas["times_s"]) == {"training step", "replica check"}
    assert replicas["tensors"] == 8 and replicas["check_over_epoch"] > 0
    midepoch = json.loads((results / "raw" / "midepoch_2.json").read_text())
    assert set(midepoch["stall_s"]) == {"synchronous", "asynchronous"}
    assert all(row["runs_s"] for row in midepoch["stall_s"].values())  # saves were made
    assert set(midepoch["first_batch_s"]) == {"indices 0", "indices 30", "loaded 0", "loaded 30"}
    streams = json.loads((results / "raw" / "streams_2.json").read_text())
    read = streams["read_by_rank"]
    # the main process reads a dispatched stream; each rank its own share of one that splits itself
    assert read["plain, dispatched"] == [640, 0] and read["plain, every rank reads"] == [640, 640]
    assert read["splits itself"] == [320, 320]
    assert set(streams["first_batch_s"]) == {
        "recorded 0",
        "recorded 10",
        "read again 0",
        "read again 10",
    }

    memory = json.loads((results / "raw" / "epoch_memory_2000_2_0.json").read_text())
    plain = json.loads((results / "raw" / "epoch_memory_2000_1_0.json").read_text())
    assert (memory["processes"], len(memory["ranks"]), plain["processes"]) == (2, 2, 1)
    for rank in memory["ranks"] + plain["ranks"]:
        assert rank["peak_growth_mb"] > 0 and rank["epoch_end_s"] > 0
    spread = json.loads((results / "raw" / "epoch_memory_everywhere_2000_2_0.json").read_text())
    assert spread["everywhere"] and len(spread["ranks"]) == 2
    merge = json.loads((results / "raw" / "batch_merge_2000_2.json").read_text())
    assert merge["records"] == 2000 and all(r["merge_cpu_s"] > 0 for r in merge["ranks"])
    assert (results / "bench_memory.png").read_bytes()[:4] == b"\x89PNG"

    # each kind, the net's and a hand-written loop's, under each allocator
    for allocator, malloc in (("default", {}), ("tuned", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
        for kind in ("ddp", "fsdp"):
            name = f"sharded_memory_{kind}_2_{allocator}.json"
            sharded = json.loads((results / "raw" / name).read_text())
            assert (sharded["kind"], sharded["processes"], len(sharded["ranks"])) == (kind, 2, 2)
            assert (sharded["allocator"], sharded["loop"]) == (malloc, False)
            for rank in sharded["ranks"]:
                phases = rank["phases"]
                assert set(phases) == {
                    "initialize",
                    "fit",
                    "save_params",
                    "load_params",
                    "save_state",
                    "load_state",
                }
                assert all(p["seconds"] > 0 for p in phases.values())
                assert all(p["malloc_free_mb"] >= 0 for p in phases.values())
            name = f"sharded_memory_{kind}_loop_2_{allocator}.json"
            loop = json.loads((results / "raw" / name).read_text())
            assert (loop["kind"], loop["allocator"], loop["loop"]) == (kind, malloc, True)
            assert all(set(rank["phases"]) == {"fit"} for rank in loop["ranks"])
    timing = json.loads((results / "raw" / "sharded_time_2.json").read_text())
    assert set(timing["ranks"][0]) == {"accelerate loop", "accel_mixin fit"}
    assert (results / "bench_sharded.png").read_bytes()[:4] == b"\x89PNG"

    control = json.loads((results / "raw" / "control_2.json").read_text())
    assert control["processes"] == 2 and len(control["ranks"]) == 2
    for rank in control["ranks"]:
        # the process group's own sockets at least: one per peer
        assert rank["sockets_after_fit"] >= rank["sockets_group"] >= 1
        assert set(rank["save_params"]) == {
            "hand-written",
            "hand-written, atomic",
            "hand-written, atomic, watched",
            "save_params",
        }
        assert rank["wait"]["core_fraction"] >= 0 and rank["wait"]["wall_s"][0] > 0
    table = (results / "bench.md").read_text()
    assert "**Control plane**" in table and "| 2 | " in table
    assert "2,000 x 100, 2 processes: main at most 1.2 x plain skorch" in table
    assert "| batch records | processes |" in table
    assert "unwrap + rewrap" in table and "| target |" in table
    assert "TrainingCheckpoint(signals=()) that never saves" in table
    assert "TrainingCheckpoint (default signals) that never saves: at most 1.01" in table
    assert "history sync: at most 1.05" in table
    assert "**beside Lightning**" in table
    assert "fit, 2 processes, without validation: at most 1.0 x lightning" in table
    assert "asynchronous checkpoint, DDP: stall" in table
    assert "asynchronous checkpoint, FSDP2: stall" in table
    assert "save_params, 2 processes: at most 1.2 x torch.save + fsync" in table
    assert "a rank waiting for the main process's write, 2 processes: under 2%" in table
    assert "replica check: at most 1% of an epoch" in table
    assert "save_params, small model" in table
    assert "**FSDP2 against DDP**" in table
    for allocator in ("glibc's default malloc", "MALLOC_MMAP_THRESHOLD_=65536"):
        target = f"FSDP2 fit, 2 processes, {allocator}: peak memory per rank at most 0.6 x DDP's"
        assert target in table
        assert f"| 2 | {allocator} | fit |" in table
    assert "| loop FSDP2 / DDP |" in table
    assert "FSDP2 fit, 2 processes: at most 1.05 x a hand-written accelerate FSDP2 loop" in table
    assert "restart to the first batch: flat" in table and "**Inside an epoch**" in table
    assert "**Streams**" in table and "read again (s)" in table
    assert (results / "bench.png").read_bytes()[:4] == b"\x89PNG"
    text = readme.read_text()
    assert "**Checkpoints beside Lightning**" in text and "**What each resumes exactly**" in text
    # the README gets the targets (the end of bench.md) and the chart, not every table
    goals = table[table.index("| target |") :]
    assert "old" not in text and goals in text and "![benchmarks](results/bench.png)" in text
    assert "**fit, 1 process**" in table and "**fit, 1 process**" not in text
    assert text.startswith("before\n") and text.endswith("after\n")
