"""Every module of the package is held to full type hints by mypy
(``scripts/typecheck``): a new module joins the strict list in
``pyproject.toml``."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

ROOT = Path(__file__).resolve().parent.parent


def modules():
    for path in sorted((ROOT / "accel_mixin").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def strict():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    for override in config["overrides"]:
        if override.get("disallow_untyped_defs"):
            yield from override["module"]


def test_every_module_is_in_mypy_s_strict_list():
    assert set(modules()) - set(strict()) == set()
    assert set(strict()) - set(modules()) == set()  # none listed that is gone
