"""scripts/lines counts each subsystem's lines, in the tree and at a git ref."""

import subprocess
import textwrap

import line_count  # scripts/line_count.py
import pytest
from harness import ROOT

SAMPLE = textwrap.dedent(
    '''\
    """A module docstring,
    on two lines."""

    # a comment
    import os  # a trailing comment


    def f(x):
        """A docstring."""
        text = """a string that is code,
        not a docstring"""
        return (x +
                1)
    '''
)


def test_code_lines_leave_out_blanks_comments_and_docstrings():
    # import, def, text = (2 lines), return (2 lines)
    assert line_count.code_lines(SAMPLE) == 6


def test_each_subpackage_and_top_level_module_is_a_subsystem_with_a_total():
    sizes = line_count.count(
        [
            ("accel_mixin/callbacks.py", "a = 1\n"),
            ("accel_mixin/training/epochs.py", "a = 1\nb = 2\n"),
            ("accel_mixin/training/deep/rows.py", "# only a comment\n"),
        ]
    )
    assert dict(sizes) == {
        "callbacks.py": [1, 1, 1],
        "training/": [2, 3, 2],
        "total": [3, 4, 3],
    }
    assert line_count.order(sizes) == ["training/", "callbacks.py"]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_a_ref_is_read_as_git_show_gives_each_file():
    read = dict(line_count.sources_at("HEAD"))
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", "HEAD", "--", "accel_mixin/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert set(read) == {p for p in listed if p.endswith(".py")}
    for path, source in read.items():
        shown = subprocess.run(
            ["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        assert source == shown, path
