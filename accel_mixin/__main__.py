"""``python -m accel_mixin env``: what a bug report needs (``diagnostics``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch.distributed as dist

from accel_mixin.diagnostics import environment_report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m accel_mixin")
    parser.add_argument(
        "command", choices=["env"], help="env: versions, what accelerate sees, every rank's layout"
    )
    parser.parse_args(argv)
    report = environment_report()
    if report is not None:
        print(report, flush=True)
    if dist.is_available() and dist.is_initialized():
        # while Python is whole: left to its exit, gloo's threads can abort it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
