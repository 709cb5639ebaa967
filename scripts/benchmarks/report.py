"""Turn the benchmarks' JSON into markdown tables, a PNG chart, and the
README's benchmark section (the targets and the chart; the guide's
benchmarks page includes every table from results/bench.md)."""

import argparse
import json
import re
import statistics
from pathlib import Path

from memory_report import (
    load_everywhere,
    load_memory,
    memory_chart,
    memory_tables,
    memory_targets,
)
from sharded_report import load_sharded, sharded_chart, sharded_tables, sharded_targets

# variants of fit.py with a TrainingCheckpoint that never saves: it polls
# for preemption notices (a small non-blocking all-reduce on several
# processes) about every half second of training, or after every batch as
# it did before; with signals=() on every rank it stops after the first batch
POLLING = "accel_mixin, notices polled"
EVERY_BATCH = "accel_mixin, notices polled every batch"
QUIET = "accel_mixin, signals=()"
PADDED = "accel_mixin, padding trains"

README_START = "<!-- bench:start -->"
README_END = "<!-- bench:end -->"


def load(raw, name):
    path = Path(raw) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def verdict(ok):
    return "met" if ok else "**missed**"


def fit_table(result, title):
    res = result["results"]
    lines = [
        f"**{title}** ({result['setup']}; median of {len(next(iter(res.values()))['runs_s'])} "
        "runs in rotating order, after a warm-up; 'paired rounds' is the median of the "
        "ratios within each round)",
        "",
        "| variant | median fit (s) | vs "
        + result["baseline"]
        + " | paired rounds | vs incumbent | valid_acc |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    incumbent = res["incumbent"]["median_s"]
    for name, row in res.items():
        shown = name + (
            " (criterion workaround)"
            if name == "incumbent" and result["incumbent_workaround"]
            else ""
        )
        lines.append(
            f"| {shown} | {row['median_s']:.3f} | {row['ratio']:.3f} | {row['paired_ratio']:.3f} | "
            f"{row['median_s'] / incumbent:.3f} | {result['valid_acc'][name]:.4f} |"
        )
    return lines


def lightning_table(result):
    """accel_mixin's fit time over Lightning's and a hand loop's, per setup."""
    first = next(iter(result["results"].values()))
    lines = [
        f"**beside Lightning** ({result['processes']} processes, {result['setup']}; "
        f"Lightning {result['versions']['lightning']}; median of "
        f"{len(first['accel_mixin']['runs_s'])} rounds in rotating order, after a warm-up)",
        "",
        "| setup | variant | median fit (s) | accel_mixin over it, paired rounds |",
        "|---|---|---:|---:|",
    ]
    for setup, res in result["results"].items():
        for name, row in res.items():
            ours = 1 / row["paired_ratio"]
            lines.append(f"| {setup} | {name} | {row['median_s']:.3f} | {ours:.3f} |")
    return lines


def _exactly(row):
    difference = row["largest_difference"]
    said = "bit for bit" if difference == 0 else f"differs by {difference:.1e}"
    return f"{said} (from {row['from']})"


def lightning_resume_tables(result, other_count=None):
    """Checkpoint stalls and restarts beside Lightning, and what each resumes
    exactly: in the same layout and, with ``other_count``, in another."""
    stall, restart = result["stall_s"], result["restart_s"]
    lines = [
        f"**Checkpoints beside Lightning** ({result['processes']} processes, the job above "
        "without validation; medians on rank 0 in rotating order)",
        "",
        "| | accel_mixin (s) | Lightning (s) | accel_mixin over Lightning, paired rounds |",
        "|---|---:|---:|---:|",
    ]
    for label, ours, theirs in (
        ("epoch-end checkpoint stall, synchronous", "accel_mixin", "lightning"),
        ("epoch-end checkpoint stall, asynchronous", "accel_mixin async", "lightning async"),
    ):
        lines.append(
            f"| {label} | {statistics.median(stall[ours]):.4f} | "
            f"{statistics.median(stall[theirs]):.4f} | {_paired(stall[ours], stall[theirs]):.2f} |"
        )
    for point in ("epoch end", "mid-epoch"):
        ours, theirs = restart[f"accel_mixin | {point}"], restart[f"lightning | {point}"]
        lines.append(
            f"| restart to the first trained batch, from a state at the {point} | "
            f"{statistics.median(ours):.4f} | {statistics.median(theirs):.4f} | "
            f"{_paired(ours, theirs):.2f} |"
        )
    lines += [
        "",
        "**What each resumes exactly**: the resumed run's final weights against the "
        "uninterrupted run's, largest absolute difference",
        "",
        "| state | resumed on | accel_mixin | Lightning |",
        "|---|---|---|---|",
    ]
    layouts = [(result, f"{result['processes']} processes, as saved")]
    if other_count:
        layouts.append((other_count, f"{other_count['processes']} process(es)"))
    for res, layout in layouts:
        for point in ("epoch end", "mid-epoch"):
            ours, theirs = (
                res["exact"][f"accel_mixin | {point}"],
                res["exact"][f"lightning | {point}"],
            )
            lines.append(f"| {point} | {layout} | {_exactly(ours)} | {_exactly(theirs)} |")
    return lines


def checkpoint_tables(result):
    lines = [
        f"**save_params / load_params** ({result['processes']} processes, "
        f"{result['params'] / 1e6:.1f}M parameters, {result['file_mb']:.0f} MB file; the "
        "baseline is a raw torch.save of the same state dict on rank 0, or torch.load "
        "plus load_state_dict on every rank; saves write a new file, except the "
        "overwriting ones, which replace the file of the same name)",
        "",
        "| operation | variant | median (s) | vs raw torch |",
        "|---|---|---:|---:|",
    ]
    for operation in ("save", "load"):
        for name, row in result[operation].items():
            lines.append(f"| {operation} | {name} | {row['median_s']:.3f} | {row['ratio']:.2f} |")
    memory = result.get("load_memory_over_file_size")
    if memory:
        lines += [
            "",
            "**Peak memory of loading** (peak RSS above the start of load_params, sampled "
            "every millisecond on rank 0, over the file size)",
            "",
            "| variant | peak extra memory / file size |",
            "|---|---:|",
        ] + [f"| {name} | {ratio:.2f} |" for name, ratio in memory.items()]
    lines += [
        "",
        "**unwrap + rewrap** (median of one call, rank 0)",
        "",
        "| model | parameters | accel_mixin (ms) | incumbent (ms) |",
        "|---|---:|---:|---:|",
    ]
    for size, row in result["rewrap"].items():
        lines.append(
            f"| {size} | {row['params']:,} | {row['accel_mixin_ms']:.3f} | "
            f"{row['incumbent_ms']:.1f} |"
        )
    return lines


def paired(results, variant, baseline):
    """Median over rounds of variant / baseline: rounds ran side by side."""
    return _paired(results[variant]["runs_s"], results[baseline]["runs_s"])


def _paired(values, baselines):
    return statistics.median(v / b for v, b in zip(values, baselines))


_KINDS = {"ddp": "DDP", "fsdp": "FSDP2"}


def stall_table(result):
    stall = result["stall_s"]
    return [
        f"**Checkpoint stall, {_KINDS[result['kind']]}** ({result['processes']} processes, "
        f"{result['params'] / 1e6:.1f}M "
        f"parameters, {result['optimizer']}, {result['state_mb']:.0f} MB training state; "
        f"training runs {result['train_seconds_between']:.1f} s between checkpoints; the time "
        "save_state "
        "blocks training on rank 0)",
        "",
        "| TrainingCheckpoint | median stall (s) | runs (s) |",
        "|---|---:|---|",
    ] + [
        f"| {name} | {row['median_s']:.3f} | {', '.join(f'{x:.3f}' for x in row['runs_s'])} |"
        for name, row in stall.items()
    ]


def midepoch_table(result):
    stall, first = result["stall_s"], result["first_batch_s"]
    lines = [
        f"**Inside an epoch** ({result['processes']} processes, {result['params'] / 1e6:.1f}M "
        f"parameters; a save every {result['every_n_batches']} batches of one epoch; the time "
        "each save blocks training on rank 0)",
        "",
        "| TrainingCheckpoint(every_n_batches) | median stall (s) | runs (s) |",
        "|---|---:|---|",
    ] + [
        f"| {name} | {row['median_s']:.3f} | {', '.join(f'{x:.3f}' for x in row['runs_s'])} |"
        for name, row in stall.items()
    ]
    lines += [
        "",
        f"**Restart to the first trained batch** (a shuffled dataloader, {result['load_us']:.0f} "
        "µs to load a sample, batches of 32; skipping by indices, as a resumed epoch does, "
        "against loading and dropping the skipped batches)",
        "",
        "| batches skipped | by indices (s) | loaded and dropped (s) |",
        "|---:|---:|---:|",
    ] + [
        f"| {skip} | {first[f'indices {skip}']['median_s']:.4f} | "
        f"{first[f'loaded {skip}']['median_s']:.4f} |"
        for skip in result["skips"]
    ]
    return lines


def streams_table(result):
    epoch, read, first = result["epoch_s"], result["read_by_rank"], result["first_batch_s"]
    n, baseline = result["processes"], epoch["dataset"]["median_s"]
    lines = [
        f"**Streams** ({n} processes, {result['samples']} samples of {result['load_us']:.0f} µs "
        f"to read, batches of {result['batch_size']}; one epoch of fit; the samples each rank "
        "read)",
        "",
        "| training data | epoch (s) | x the Dataset | samples read, by rank |",
        "|---|---:|---:|---|",
    ] + [
        f"| {kind} | {row['median_s']:.3f} | {row['median_s'] / baseline:.2f} | "
        f"{', '.join(map(str, read[kind]))} |"
        for kind, row in epoch.items()
    ]
    lines += [
        "",
        "**A stream resumed inside an epoch, to its first batch** (from the position the stream "
        "records, through SplitStream, against torchdata's StatefulDataLoader over the same "
        "stream without state_dict, which reads the samples before the position again)",
        "",
        "| batches before the position | recorded position (s) | read again (s) |",
        "|---:|---:|---:|",
    ] + [
        f"| {p} | {first[f'recorded {p}']['median_s']:.4f} | "
        f"{first[f'read again {p}']['median_s']:.4f} |"
        for p in result["positions"]
    ]
    return lines


def streams_targets(result):
    if not result:
        return []
    first = result["first_batch_s"]
    positions = [p for p in result["positions"] if p]
    low, high = min(positions), max(positions)
    ratio = first[f"recorded {high}"]["median_s"] / first[f"recorded {low}"]["median_s"]
    return [
        (
            f"a stream resumed inside an epoch, to its first batch: flat in the position "
            f"({high} batches against {low}: at most 2 x)",
            f"{ratio:.2f}",
            ratio <= 2,
        )
    ]


def replicas_table(result):
    times = result["times_s"]
    return (
        [
            f"**Replica check** ({result['processes']} processes, {result['params'] / 1e6:.1f}M "
            f"parameters in {result['tensors']} tensors; an epoch is {result['steps_per_epoch']} "
            f"training steps: {result['epoch_samples']} samples, batch {result['batch_size']} per "
            "process; medians on rank 0)",
            "",
            "| | median (s) | runs (s) |",
            "|---|---:|---|",
        ]
        + [
            f"| {name} | {row['median_s']:.4f} | {', '.join(f'{x:.4f}' for x in row['runs_s'])} |"
            for name, row in times.items()
        ]
        + [
            "",
            f"The check costs {result['check_over_step']:.3f} of one training step, "
            f"{100 * result['check_over_epoch']:.3f}% of an epoch.",
        ]
    )


def _control_figures(result):
    """``(save_params' paired ratio, the waiting ranks' largest core
    fraction, the most sockets after a fit)`` of one control.py result."""
    ranks = result["ranks"]
    return (
        ranks[0]["save_params"]["save_params"]["paired_ratio"],
        max(r["wait"]["core_fraction"] for r in ranks[1:]),
        max(r["sockets_after_fit"] for r in ranks),
    )


def control_table(results):
    """Sockets, a waiting rank's CPU and ``save_params`` against a
    hand-written save, per number of processes (control.py)."""
    lines = [
        "**Control plane** (rank 0 writes, the other ranks wait)",
        "",
        "| processes | sockets: group | sockets: after fit | waiting rank, core fraction (max) "
        "| save_params / torch.save+fsync (paired) "
        "| save_params / the same, atomic (medians) "
        "| save_params / the same, atomic, on a watched thread (paired) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        ranks = result["ranks"]
        ratio, waiting, sockets = _control_figures(result)
        saves = ranks[0]["save_params"]
        atomic = saves.get("hand-written, atomic")
        over_atomic = (
            f"{saves['save_params']['median_s'] / atomic['median_s']:.2f}" if atomic else "-"
        )
        watched = saves.get("hand-written, atomic, watched")
        over_watched = "-"
        if watched:
            over_watched = f"{_paired(saves['save_params']['runs_s'], watched['runs_s']):.2f}"
        lines.append(
            f"| {result['processes']} | {max(r['sockets_group'] for r in ranks)} | "
            f"{sockets} | {waiting:.3f} | {ratio:.2f} "
            f"| {over_atomic} | {over_watched} |"
        )
    return lines


def control_targets(results):
    """Issue 47's control-plane targets, per number of processes."""
    rows = []
    for result in results:
        n = result["processes"]
        ratio, waiting, sockets = _control_figures(result)
        rows += [
            (
                f"save_params, {n} processes: at most 1.2 x torch.save + fsync between two "
                "gloo barriers (paired)",
                f"{ratio:.2f}",
                ratio <= 1.2,
            ),
            (
                f"a rank waiting for the main process's write, {n} processes: under 2% of a core",
                f"{100 * waiting:.1f}%",
                waiting < 0.02,
            ),
            (
                f"sockets per process after a fit, {n} processes: at most 2N+1 (the process "
                "group's and one gloo group's)",
                str(sockets),
                sockets <= 2 * n + 1,
            ),
        ]
    return rows


def small_save_table(result):
    return [
        f"**save_params of a small model** ({result['processes']} processes, "
        f"{result['params'] / 1e6:.2f}M parameters, {result['file_mb']:.1f} MB file: fixed "
        "costs such as barriers show most here)",
        "",
        "| variant | median (s) | vs raw torch |",
        "|---|---:|---:|",
    ] + [
        f"| {name} | {row['median_s']:.4f} | {row['ratio']:.2f} |"
        for name, row in result["save"].items()
    ]


def _durable_ratio(checkpoint):
    save = checkpoint["save"]
    return save["accel_mixin"]["median_s"] / save["torch.save + fsync"]["median_s"]


def targets(
    fit1,
    fit2,
    checkpoint,
    stall=None,
    replicas=None,
    checkpoint_small=None,
    midepoch=None,
    lightning=None,
    more=(),
):
    """Fit targets use paired rounds: the machine drifts more between rounds
    than the differences measured."""
    rows = []
    for setup, res in (lightning or {}).get("results", {}).items():
        for name, bound in (("lightning", 1.0), ("accelerate loop", 1.05)):
            ratio = 1 / res[name]["paired_ratio"]
            rows.append(
                (
                    f"fit, 2 processes, {setup}: at most {bound} x {name}",
                    f"{ratio:.3f}",
                    ratio <= bound,
                )
            )
    if fit1:
        res = fit1["results"]
        ratio = paired(res, "accel_mixin", "skorch")
        rows.append(("fit, 1 process: at most 1.05 x plain skorch", f"{ratio:.3f}", ratio <= 1.05))
        ratio = paired(res, "accel_mixin", "incumbent")
        rows.append(("fit, 1 process: no slower than the incumbent", f"{ratio:.3f}", ratio <= 1.0))
    if fit2:
        res = fit2["results"]
        ratio = paired(res, "accel_mixin", "incumbent")
        rows.append(
            ("fit, 2 processes: no slower than the incumbent", f"{ratio:.3f}", ratio <= 1.0)
        )
        # (variant, its baseline, the target's words, the bound): where run
        optional = (
            ("accel_mixin", "accel_mixin, no history sync", "history sync", 1.05),
            (POLLING, "accel_mixin", "TrainingCheckpoint (default signals) that never saves", 1.01),
            (QUIET, "accel_mixin", "TrainingCheckpoint(signals=()) that never saves", 1.05),
            ("accel_mixin", PADDED, "N processes train as one (shares of the last batch)", 1.01),
        )
        for variant, baseline, words, bound in optional:
            if variant in res and baseline in res:
                ratio = paired(res, variant, baseline)
                rows.append(
                    (f"{words}: at most {bound} x fit without it", f"{ratio:.3f}", ratio <= bound)
                )
    if checkpoint:
        save = checkpoint["save"]
        ratio = save["accel_mixin"]["ratio"]
        rows.append(("save_params: at most 1.15 x raw torch.save", f"{ratio:.2f}", ratio <= 1.15))
        if "torch.save + fsync" in save:
            ratio = _durable_ratio(checkpoint)
            rows.append(
                (
                    "save_params: at most 1.15 x torch.save + fsync (atomic writes fsync)",
                    f"{ratio:.2f}",
                    ratio <= 1.15,
                )
            )
        memory = checkpoint.get("load_memory_over_file_size")
        if memory:
            ratio = memory["accel_mixin"]
            rows.append(
                (
                    "loading: peak extra memory at most 1.1 x the file size",
                    f"{ratio:.2f}",
                    ratio <= 1.1,
                )
            )
        worst = max(row["accel_mixin_ms"] for row in checkpoint["rewrap"].values())
        rows.append(("unwrap + rewrap: under 1 ms at every size", f"{worst:.3f} ms", worst < 1.0))
    if checkpoint_small:
        ratio = _durable_ratio(checkpoint_small)
        rows.append(
            (
                f"save_params, small model ({checkpoint_small['file_mb']:.1f} MB): at most "
                "1.15 x torch.save + fsync",
                f"{ratio:.2f}",
                ratio <= 1.15,
            )
        )
    for result in stall or ():
        ratio = result["ratio"]
        rows.append(
            (
                f"asynchronous checkpoint, {_KINDS[result['kind']]}: stall at most 1/4 of the "
                "synchronous save",
                f"{ratio:.2f}",
                ratio <= 0.25,
            )
        )
    if midepoch:
        first, skips = midepoch["first_batch_s"], midepoch["skips"]
        ratio = (
            first[f"indices {max(skips)}"]["median_s"] / first[f"indices {min(skips)}"]["median_s"]
        )
        rows.append(
            (
                f"restart to the first batch: flat in the batches skipped ({max(skips)} "
                f"against {min(skips)}: at most 2 x)",
                f"{ratio:.2f}",
                ratio <= 2,
            )
        )
    if replicas:
        share = replicas["check_over_epoch"]
        rows.append(("replica check: at most 1% of an epoch", f"{100 * share:.3f}%", share <= 0.01))
    rows += more
    lines = ["| target | measured | |", "|---|---:|---|"]
    lines += [f"| {name} | {value} | {verdict(ok)} |" for name, value, ok in rows]
    save = checkpoint and checkpoint["save"]
    if save and "torch.save + fsync" in save:
        fsync = save["torch.save + fsync"]["median_s"] / save["torch.save"]["median_s"]
        lines += [
            "",
            f"save_params fsyncs each file before renaming it into place, as an "
            "atomic write must for the previous checkpoint to survive a crash of "
            "the machine; a raw torch.save only fills the page cache. Here the "
            f"fsync alone makes torch.save take {fsync:.2f} x as long, so where "
            "that exceeds 1.15 the target against raw torch.save cannot be met "
            "by a durable write: torch.save + fsync is the I/O limit that applies.",
        ]
    if checkpoint_small and _durable_ratio(checkpoint_small) > 1.15:
        extra = 1e3 * (
            checkpoint_small["save"]["accel_mixin"]["median_s"]
            - checkpoint_small["save"]["torch.save + fsync"]["median_s"]
        )
        lines += [
            "",
            f"A small save_params costs {extra:.1f} ms more than a durable write "
            "of the same state. What a coordinated atomic save adds to it: the "
            "net is unwrapped; the main process writes its state to a "
            "temporary file on its watched worker thread while the ranks meet in "
            "a control barrier, and renames it into place; then it sends each "
            "other rank the outcome, for which they wait in one receive "
            "(docs/guide/architecture.md). The control bench times this save "
            "against the same write done by hand (scripts/benchmarks/control.py).",
        ]
    if fit2 and POLLING in fit2["results"]:
        ratio = paired(fit2["results"], POLLING, "accel_mixin")
        lines += [
            "",
            "With signals to handle (SIGTERM by default), TrainingCheckpoint polls for "
            "preemption notices with one small non-blocking all-reduce at batches the ranks "
            "agree on: about every half second of training at the slowest rank's pace, at "
            "most 64 batches apart, and at every epoch's end. Here a fit with a "
            f"TrainingCheckpoint that never saves ('{POLLING}') takes {ratio:.3f} x as long, "
            "on an MLP whose batches take a few milliseconds.",
        ]
        if EVERY_BATCH in fit2["results"]:
            every = paired(fit2["results"], EVERY_BATCH, "accel_mixin")
            lines[-1] += (
                f" Polling after every batch, as before, takes {every:.3f} x ('{EVERY_BATCH}')."
            )
        lines[-1] += " With signals=() on every rank nothing is polled after a fit's first batch."
    if fit1 or fit2:
        lines += [
            "",
            'Fit ratios are the median of the per-round ratios ("paired rounds" '
            "in the fit tables): the machine drifts more between rounds than the differences "
            "measured, so the ratio of overall medians can differ.",
        ]
    return lines


def chart(fit1, fit2, checkpoint, path):
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        p
        for p in (
            ("fit, 1 process (s)", fit1 and fit1["results"]),
            ("fit, 2 processes (s)", fit2 and fit2["results"]),
            ("save_params, 2 processes (s)", checkpoint and checkpoint["save"]),
            ("load_params, 2 processes (s)", checkpoint and checkpoint["load"]),
        )
        if p[1]
    ]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (title, res) in zip(axes[0], panels):
        names = list(res)
        ax.bar(
            range(len(names)),
            [res[n]["median_s"] for n in names],
            color=["#d62728" if n == "accel_mixin" else "#7f7f7f" for n in names],
        )
        for i, name in enumerate(names):
            ax.plot([i] * len(res[name]["runs_s"]), res[name]["runs_s"], "k.", ms=3)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--raw", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--readme", default=None)
    parser.add_argument("--command", default="scripts/bench")
    args = parser.parse_args()

    fit1, fit2, checkpoint, checkpoint_small, replicas, midepoch, lightning, *resume = (
        load(args.raw, n)
        for n in (
            "fit_1",
            "fit_2",
            "checkpoint_2",
            "checkpoint_small_2",
            "replicas_2",
            "midepoch_2",
            "lightning_2",
            "lightning_resume_2",
            "lightning_resume_1",
        )
    )
    lines = [f"Reproduce with `{args.command}`. Bars are medians, dots single runs.", ""]
    for result, title in ((fit1, "fit, 1 process"), (fit2, "fit, 2 processes")):
        if result:
            lines += fit_table(result, title) + [""]
    if lightning:
        lines += lightning_table(lightning) + [""]
    if checkpoint:
        lines += checkpoint_tables(checkpoint) + [""]
    if checkpoint_small:
        lines += small_save_table(checkpoint_small) + [""]
    stall = [r for r in (load(args.raw, n) for n in ("stall_2", "stall_fsdp_2")) if r]
    for result in stall:
        lines += stall_table(result) + [""]
    if midepoch:
        lines += midepoch_table(midepoch) + [""]
    streams = load(args.raw, "streams_2")
    if streams:
        lines += streams_table(streams) + [""]
    if replicas:
        lines += replicas_table(replicas) + [""]
    control = [c for c in (load(args.raw, f"control_{n}") for n in (2, 4, 8)) if c]
    if control:
        lines += control_table(control) + [""]
    fits, merges = load_memory(args.raw)
    if fits:
        lines += memory_tables(fits, merges, load_everywhere(args.raw)) + [""]
    sharded_memory, sharded_timing, parameters = load_sharded(args.raw)
    if sharded_memory or sharded_timing:
        lines += sharded_tables(sharded_memory, sharded_timing, parameters) + [""]
    goals = targets(
        fit1,
        fit2,
        checkpoint,
        stall,
        replicas,
        checkpoint_small,
        midepoch,
        lightning,
        more=memory_targets(fits, merges)
        + sharded_targets(sharded_memory, sharded_timing)
        + control_targets(control)
        + streams_targets(streams),
    )
    if resume[0]:
        # with the targets, on the front page
        goals += [""] + lightning_resume_tables(*resume)
    lines += goals
    text = "\n".join(lines) + "\n"

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(text)
    has_chart = chart(fit1, fit2, checkpoint, out / "bench.png")
    has_memory_chart = memory_chart(fits, out / "bench_memory.png")
    has_sharded_chart = sharded_chart(sharded_memory, out / "bench_sharded.png")
    print(text)

    if args.readme:
        readme = Path(args.readme)
        # the README is the front page: the targets and the chart; every table
        # is in bench.md, which docs/guide/benchmarks.md includes
        block = "\n".join(goals) + "\n"
        block += "\n![benchmarks](results/bench.png)\n" if has_chart else ""
        block += "\n![epoch end memory](results/bench_memory.png)\n" if has_memory_chart else ""
        block += "\n![FSDP2 memory](results/bench_sharded.png)\n" if has_sharded_chart else ""
        pattern = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.S)
        new = pattern.sub(lambda _: f"{README_START}\n{block}{README_END}", readme.read_text())
        readme.write_text(new)


if __name__ == "__main__":
    main()
