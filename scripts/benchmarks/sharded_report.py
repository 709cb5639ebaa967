"""FSDP2 against DDP (``sharded.py``): memory per rank under glibc's default
allocator and a tuned one, the net's and a hand-written loop's, save and
load, and the fit's time against a hand-written accelerate loop; tables,
targets and a chart."""

import json
from pathlib import Path

__all__ = ["load_sharded", "sharded_chart", "sharded_tables", "sharded_targets"]

# per-rank peak while fitting, FSDP2 against DDP, at most (issue 37)
MEMORY_TARGETS = {2: 0.6, 4: 0.35}
TIME_TARGET = 1.05
PHASES = ("initialize", "fit", "save_params", "load_params", "save_state", "load_state")
# run.py's allocators, by the MALLOC_* variables a result ran under
TUNED = {"MALLOC_MMAP_THRESHOLD_": "65536"}
ALLOCATOR_NAMES = {"default": "glibc's default malloc", "tuned": "MALLOC_MMAP_THRESHOLD_=65536"}


def _allocator(result):
    # results from before the allocator was recorded ran tuned (run.py set it)
    settings = result.get("allocator", TUNED)
    if not settings:
        return "default"
    if settings == TUNED:
        return "tuned"
    return " ".join(f"{k}={v}" for k, v in settings.items())


def _name(allocator):
    return ALLOCATOR_NAMES.get(allocator, allocator)


def load_sharded(raw):
    """``({(kind, processes, allocator): [rank phases]}, {processes: timing
    of rank 0}, parameters)``; a hand-written loop's kind is ``"fsdp loop"``
    or ``"ddp loop"``, an allocator ``"default"``, ``"tuned"`` or the
    ``MALLOC_*`` settings."""
    memory, timing, parameters = {}, {}, None
    for path in sorted(Path(raw).glob("sharded_*.json")):
        result = json.loads(path.read_text())
        if result["variant"] == "memory":
            kind = result["kind"] + (" loop" if result.get("loop") else "")
            key = (kind, result["processes"], _allocator(result))
            memory[key] = [r["phases"] for r in result["ranks"]]
            parameters = result["ranks"][0]["parameters"]
        else:
            timing[result["processes"]] = result["ranks"][0]
    return memory, timing, parameters


def _largest(ranks, phase, key="peak_mb"):
    return max(rank[phase][key] for rank in ranks)


def _phases(*kinds):
    """The phases every result of ``kinds`` measured (older ones fewer)."""
    return [p for p in PHASES if all(p in rank for ranks in kinds for rank in ranks)]


def _pairs(memory):
    """``(processes, allocator)`` with both the net's DDP and FSDP2 results,
    the default allocator first."""
    keys = {(n, a) for kind, n, a in memory if kind == "ddp" and ("fsdp", n, a) in memory}
    return sorted(keys, key=lambda key: (key[0], key[1] != "default", key[1] != "tuned", key[1]))


def _ratio(memory, n, allocator, kinds=("fsdp", "ddp")):
    fsdp, ddp = (memory.get((kind, n, allocator)) for kind in kinds)
    if not (fsdp and ddp):
        return None
    return _largest(fsdp, "fit") / _largest(ddp, "fit")


def _fit_table(memory):
    lines = [
        "The fit's peak per rank (MB, the largest rank) under each allocator, the net's "
        "and a hand-written accelerate loop's (the model built, prepared, one epoch), "
        "and what glibc held freed in its heaps at the end of the net's FSDP2 fit:",
        "",
        "| processes | allocator | DDP | FSDP2 | FSDP2 / DDP | DDP loop | FSDP2 loop "
        "| loop FSDP2 / DDP | FSDP2: freed, kept by glibc |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, allocator in _pairs(memory):
        cells = []
        for kind in ("ddp", "fsdp"):
            cells.append(f"{_largest(memory[(kind, n, allocator)], 'fit'):.0f}")
        cells.append(f"{_ratio(memory, n, allocator):.2f}")
        for kind in ("ddp loop", "fsdp loop"):
            ranks = memory.get((kind, n, allocator))
            cells.append(f"{_largest(ranks, 'fit'):.0f}" if ranks else "")
        loops = _ratio(memory, n, allocator, ("fsdp loop", "ddp loop"))
        cells.append(f"{loops:.2f}" if loops else "")
        kept = [r["fit"].get("malloc_free_mb") for r in memory[("fsdp", n, allocator)]]
        cells.append(f"{max(kept):.0f}" if None not in kept else "")
        lines.append(f"| {n} | {_name(allocator)} | " + " | ".join(cells) + " |")
    return lines


def sharded_tables(memory, timing, parameters):
    lines = [
        f"**FSDP2 against DDP** ({parameters / 1e6:.1f}M parameters, Adam)" if parameters else "",
        "",
    ]
    if memory:
        lines += _fit_table(memory) + [
            "",
            "Each rank's resident memory above what it held before the net was built, "
            "in MB (the largest rank); seconds of rank 0.",
            "",
            "| processes | allocator | phase | DDP MB | FSDP2 MB | FSDP2 / DDP | DDP s | FSDP2 s |",
            "|---:|---|---|---:|---:|---:|---:|---:|",
        ]
    for n, allocator in _pairs(memory):
        ddp, fsdp = memory[("ddp", n, allocator)], memory[("fsdp", n, allocator)]
        for phase in _phases(ddp, fsdp):
            d, f = _largest(ddp, phase), _largest(fsdp, phase)
            lines.append(
                f"| {n} | {_name(allocator)} | {phase} | {d:.0f} | {f:.0f} | {f / d:.2f} | "
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
    per rank against DDP's under each allocator, and the fit's time against
    the loop's."""
    rows = []
    for n, allocator in _pairs(memory):
        target = MEMORY_TARGETS.get(n)
        if target is None:
            continue
        ratio = _ratio(memory, n, allocator)
        rows.append(
            (
                f"FSDP2 fit, {n} processes, {_name(allocator)}: peak memory per rank at most "
                f"{target} x DDP's",
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
    """Peak memory per rank in each phase, DDP and FSDP2 side by side, a row
    per allocator; False without results (or without matplotlib)."""
    pairs = _pairs(memory)
    if not pairs:
        return False
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        return False
    processes = sorted({n for n, _ in pairs})
    allocators = sorted({a for _, a in pairs}, key=lambda a: (a != "default", a != "tuned", a))
    fig, axes = plt.subplots(
        len(allocators),
        len(processes),
        figsize=(5 * len(processes), 3.6 * len(allocators)),
        sharey=True,
        squeeze=False,
    )
    width = 0.38
    for row, allocator in zip(axes, allocators):
        for ax, n in zip(row, processes):
            if (n, allocator) not in pairs:
                ax.set_visible(False)
                continue
            phases = _phases(memory[("ddp", n, allocator)], memory[("fsdp", n, allocator)])
            for offset, kind, label in ((-width / 2, "ddp", "DDP"), (width / 2, "fsdp", "FSDP2")):
                peaks = [_largest(memory[(kind, n, allocator)], phase) for phase in phases]
                ax.bar([i + offset for i in range(len(phases))], peaks, width, label=label)
            ax.set_xticks(range(len(phases)), phases, rotation=15)
            ax.set_title(f"{n} processes, {_name(allocator)}", fontsize=10)
            ax.set_ylabel("peak MB per rank (largest rank)")
            ax.legend()
    fig.suptitle("FSDP2 against DDP: memory per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
