"""The epoch end's memory and time (``epoch_memory.py``): tables, targets
and a chart."""

import json
import statistics
from pathlib import Path

__all__ = ["load_everywhere", "load_memory", "memory_chart", "memory_tables", "memory_targets"]


def load_memory(raw):
    """Per ``(validation samples, processes)``: per rank, the median over the
    rounds of the peak growth (MB) and of the epoch end's seconds; and per
    ``(batch records, processes)`` the merge's slowest rank. The runs with
    ``--everywhere`` are ``load_everywhere``'s."""
    runs, merges = {}, {}
    for path in sorted(Path(raw).glob("epoch_memory_*.json")):
        result = json.loads(path.read_text())
        if result.get("everywhere"):
            continue
        runs.setdefault((result["valid"], result["processes"]), []).append(result["ranks"])
    for path in sorted(Path(raw).glob("batch_merge_*.json")):
        result = json.loads(path.read_text())
        merges[(result["records"], result["processes"])] = result["ranks"]
    return _medians(runs), merges


def load_everywhere(raw):
    """``load_memory``'s fits, for the runs with ``--everywhere``."""
    runs = {}
    for path in sorted(Path(raw).glob("epoch_memory_everywhere_*.json")):
        result = json.loads(path.read_text())
        runs.setdefault((result["valid"], result["processes"]), []).append(result["ranks"])
    return _medians(runs)


def _medians(runs):
    fits = {}
    for key, rounds in runs.items():
        fits[key] = [
            {
                name: statistics.median(r[rank][name] for r in rounds)
                for name in ("peak_growth_mb", "epoch_end_s")
            }
            for rank in range(len(rounds[0]))
        ]
    return fits


def _bounds(fits, valid, processes):
    plain = fits[(valid, 1)][0]["peak_growth_mb"]
    return plain, 1.2 * plain, plain / processes + 64


def memory_tables(fits, merges, everywhere=None):
    if not fits:
        return []
    everywhere = everywhere or {}
    lines = [
        "Epoch end, one epoch of a linear model with 100 classes, 2,000 training samples and "
        "a predefined validation set scored by `valid_acc`: peak resident memory growth "
        "during `fit` (MB, sampled every 5 ms; the median of the rounds) and the epoch end's "
        "time on rank 0 (`notify('on_epoch_end')`, the exchange included). The last column "
        "is the same with `predictions_on_every_rank = True` on `valid_acc`: every rank "
        "receives and scores the whole predictions, as every rank did before the scores "
        "moved to the main process.",
        "",
        "| validation samples | processes | main process | bound | other ranks (largest) "
        "| bound | epoch end, rank 0 (s) | predictions on every rank: main, others, "
        "epoch end (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for valid, processes in sorted(fits):
        ranks = fits[(valid, processes)]
        end = f"{ranks[0]['epoch_end_s']:.3f}"
        if processes == 1:
            lines.append(
                f"| {valid:,} | plain skorch | {ranks[0]['peak_growth_mb']:.0f} | | | | {end} | |"
            )
            continue
        _, main_bound, other_bound = _bounds(fits, valid, processes)
        other = max(r["peak_growth_mb"] for r in ranks[1:])
        spread = everywhere.get((valid, processes))
        cost = ""
        if spread:
            cost = (
                f"{spread[0]['peak_growth_mb']:.0f}, "
                f"{max(r['peak_growth_mb'] for r in spread[1:]):.0f}, "
                f"{spread[0]['epoch_end_s']:.3f}"
            )
        lines.append(
            f"| {valid:,} | {processes} | {ranks[0]['peak_growth_mb']:.0f} | {main_bound:.0f} "
            f"| {other:.0f} | {other_bound:.0f} | {end} | {cost} |"
        )
    if merges:
        lines += [
            "",
            "Merging an epoch's batch records (every rank ends with all of them), per rank: "
            "the slowest wall time, the largest CPU time of the merging thread and the "
            "largest memory growth. With more processes than this machine's 2 cores, "
            "the ranks also wait for and evict each other, which adds CPU time.",
            "",
            "| batch records | processes | wall (s) | CPU (s) | memory growth (MB) |",
            "|---:|---:|---:|---:|---:|",
        ]
        for records, processes in sorted(merges):
            ranks = merges[(records, processes)]
            lines.append(
                f"| {records:,} | {processes} | {max(r['merge_s'] for r in ranks):.3f} "
                f"| {max(r['merge_cpu_s'] for r in ranks):.3f} "
                f"| {max(r['merge_growth_mb'] for r in ranks):.0f} |"
            )
    return lines


def memory_targets(fits, merges):
    """Rows of the targets table: ``(target, result, met)``."""
    rows = []
    for valid, processes in sorted(fits):
        if processes == 1 or (valid, 1) not in fits:
            continue
        ranks = fits[(valid, processes)]
        plain, main_bound, other_bound = _bounds(fits, valid, processes)
        main = ranks[0]["peak_growth_mb"]
        other = max(r["peak_growth_mb"] for r in ranks[1:])
        rows.append(
            (
                f"epoch end, {valid:,} x 100, {processes} processes: main at most 1.2 x plain "
                "skorch, others at most plain / N + 64 MB",
                f"main {main / plain:.2f} x, others {other:.0f} of {other_bound:.0f} MB",
                main <= main_bound and other <= other_bound,
            )
        )
    by_records = {}
    for (records, processes), ranks in merges.items():
        worst = (max(r["merge_cpu_s"] for r in ranks), max(r["merge_growth_mb"] for r in ranks))
        by_records.setdefault(records, {})[processes] = worst
    for records, costs in sorted(by_records.items()):
        if len(costs) < 2:
            continue
        fewest, most = min(costs), max(costs)
        memory = costs[most][1] / costs[fewest][1]
        cpu = costs[most][0] / costs[fewest][0]
        # growing with ranks x batches would be most / fewest
        rows.append(
            (
                f"merge of {records:,} batch records, per rank, {most} against {fewest} "
                f"processes: memory at most 1.1 x, CPU under {most / fewest:.1f} x",
                f"memory {memory:.2f} x, CPU {cpu:.2f} x",
                memory <= 1.1 and cpu < most / fewest,
            )
        )
    return rows


def memory_chart(fits, path):
    """Peak growth against validation samples: plain skorch, and per process
    count the main process and the largest other rank, with their bounds."""
    if not fits:
        return False
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    sizes = sorted({valid for valid, _ in fits})
    counts = sorted({n for _, n in fits if n > 1})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, title in zip(axes, ("main process", "other ranks (largest)")):
        ax.plot(
            sizes, [fits[(s, 1)][0]["peak_growth_mb"] for s in sizes], "k-o", label="plain skorch"
        )
        for color, n in zip(("#d62728", "#1f77b4", "#2ca02c", "#9467bd"), counts):
            have = [s for s in sizes if (s, n) in fits]
            if title == "main process":
                got = [fits[(s, n)][0]["peak_growth_mb"] for s in have]
                bound = [_bounds(fits, s, n)[1] for s in have]
            else:
                got = [max(r["peak_growth_mb"] for r in fits[(s, n)][1:]) for s in have]
                bound = [_bounds(fits, s, n)[2] for s in have]
            ax.plot(have, got, "-o", color=color, label=f"{n} processes")
            ax.plot(have, bound, ":", color=color)
        ax.set_title(f"epoch end, {title} (dotted: bound)", fontsize=10)
        ax.set_xlabel("validation samples (x 100 classes)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("peak RSS growth during fit (MB)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
