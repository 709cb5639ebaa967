"""The README's usage example runs as written."""
import re
import subprocess
import sys

from harness import ROOT


def test_usage_example_runs():
    readme = (ROOT / 'README.md').read_text()
    usage = readme.split('## Usage', 1)[1]
    code = re.search(r'```python\n(.*?)```', usage, re.S).group(1)
    out = subprocess.run(
        [sys.executable, '-c', code], capture_output=True, text=True,
        timeout=120, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert 'epoch' in out.stdout
