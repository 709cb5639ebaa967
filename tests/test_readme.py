"""The README's usage example runs as written."""

import re
import subprocess
import sys

from harness import ROOT


def test_usage_example_runs():
    readme = (ROOT / "README.md").read_text()
    usage = readme.split("## Usage", 1)[1]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "epoch" in out.stdout


def test_the_module_map_lists_every_module_and_only_those():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### Modules", 1)[1].split("```")[1]
    listed = set(re.findall(r"^  (\w+\.py) ", block.split("tests/")[0], re.M))
    modules = {p.name for p in (ROOT / "accel_mixin").glob("*.py")} - {"__init__.py"}
    assert listed == modules


def test_the_lifecycle_diagram_names_modules_that_exist():
    readme = (ROOT / "README.md").read_text()
    diagram = readme.split("### The lifecycle", 1)[1].split("```")[1]
    named = set(re.findall(r"(\w+\.py)", diagram))
    assert named and named <= {p.name for p in (ROOT / "accel_mixin").glob("*.py")}
