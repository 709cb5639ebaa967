"""FSDP2 against DDP (``sharded.py``): memory per rank, save and load, and
the fit's time against a hand-written accelerate loop; tables, targets and a
chart."""

import json
from pathlib import Path

__all__ = ["load_sharded", "sharded_chart", "sharded_tables", "sharded_targets"]

# per-rank peak while fitting, FSDP2 against DDP, at most (issue 37)
MEMORY_TARGETS = {2: 0.6, 4: 0.35}
TIME_TARGET = 1.05
PHASES = ("initialize", "fit", "save_params", "load_params", "save_state", "load_state")


def load_sharded(raw):
    """``({(kind, processes): [rank phases]}, {processes: timing of rank 0}, parameters)``."""
    memory, timing, parameters = {}, {}, None
    for path in sorted(Path(raw).glob("sharded_*.json")):
        result = json.loads(path.read_text())
        if result["variant"] == "memory":
            memory[(result["kind"], result["processes"])] = [r["phases"] for r in result["ranks"]]
            parameters = result["ranks"][0]["parameters"]
        else:
            timing[result["processes"]] = result["ranks"][0]
    return memory, timing, parameters


def _largest(ranks, phase, key="peak_mb"):
    return max(rank[phase][key] for rank in ranks)


def _phases(*kinds):
    """The phases every result of ``kinds`` measured (older ones fewer)."""
    return [p for p in PHASES if all(p in rank for ranks in kinds for rank in ranks)]


def _processes(memory):
    return sorted({n for kind, n in memory if (("ddp", n) in memory and ("fsdp", n) in memory)})


def sharded_tables(memory, timing, parameters):
    lines = [
        f"**FSDP2 against DDP** ({parameters / 1e6:.1f}M parameters, Adam)",
        "",
        "Each rank's resident memory above what it held before the net was built, "
        "in MB (the largest rank); seconds of rank 0.",
        "",
        "| processes | phase | DDP MB | FSDP2 MB | FSDP2 / DDP | DDP s | FSDP2 s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for n in _processes(memory):
        ddp, fsdp = memory[("ddp", n)], memory[("fsdp", n)]
        for phase in _phases(ddp, fsdp):
            d, f = _largest(ddp, phase), _largest(fsdp, phase)
            lines.append(
                f"| {n} | {phase} | {d:.0f} | {f:.0f} | {f / d:.2f} | "
                f"{ddp[0][phase]['seconds']:.2f} | {fsdp[0][phase]['seconds']:.2f} |"
            )
    if timing:
        lines += [
            "",
            "| processes | variant | median s | paired ratio to the loop |",
            "|---:|---|---:|---:|",
        ]
        for n, result in sorted(timing.items()):
            for name, row in result.items():
                lines.append(
                    f"| {n} | {name} | {row['median_s']:.2f} | {row['paired_ratio']:.3f} |"
                )
    return lines


def sharded_targets(memory, timing):
    """Rows of the targets table: ``(target, result, met)``: the fit's peak
    per rank against DDP's, and the fit's time against the loop's."""
    rows = []
    for n in _processes(memory):
        target = MEMORY_TARGETS.get(n)
        if target is None:
            continue
        ratio = _largest(memory[("fsdp", n)], "fit") / _largest(memory[("ddp", n)], "fit")
        rows.append(
            (
                f"FSDP2 fit, {n} processes: peak memory per rank at most {target} x DDP's",
                f"{ratio:.2f} x",
                ratio <= target,
            )
        )
    for n, result in sorted(timing.items()):
        ratio = result["accel_mixin fit"]["paired_ratio"]
        rows.append(
            (
                f"FSDP2 fit, {n} processes: at most {TIME_TARGET} x a hand-written "
                "accelerate FSDP2 loop",
                f"{ratio:.3f}",
                ratio <= TIME_TARGET,
            )
        )
    return rows


def sharded_chart(memory, path):
    """Peak memory per rank in each phase, DDP and FSDP2 side by side; False
    without results (or without matplotlib)."""
    processes = _processes(memory)
    if not processes:
        return False
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(processes), figsize=(5 * len(processes), 3.6), sharey=True)
    axes = [axes] if len(processes) == 1 else list(axes)
    width = 0.38
    for ax, n in zip(axes, processes):
        phases = _phases(memory[("ddp", n)], memory[("fsdp", n)])
        for offset, kind, label in ((-width / 2, "ddp", "DDP"), (width / 2, "fsdp", "FSDP2")):
            peaks = [_largest(memory[(kind, n)], phase) for phase in phases]
            ax.bar([i + offset for i in range(len(phases))], peaks, width, label=label)
        ax.set_xticks(range(len(phases)), phases, rotation=15)
        ax.set_title(f"{n} processes")
        ax.set_ylabel("peak MB per rank (largest rank)")
        ax.legend()
    fig.suptitle("FSDP2 against DDP: memory per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
