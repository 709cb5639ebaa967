"""Warnings of torch's C++ code dropped from the stderr descriptor, the rest kept.

In a subprocess, so that this process's descriptor 2 stays as it is. The
real case, DDP's reducer warning on rank 1: test_sync.py::test_one_voice.
"""

import subprocess
import sys
import textwrap

import pytest

from accel_mixin.native_output import is_native_warning

SCRIPT = textwrap.dedent("""
    import os, sys
    from accel_mixin.native_output import native_warnings_dropped

    def lines():
        os.write(2, b'[rank1]:[W1130 15:27:58.469831308 reducer.cpp:1529] Warning: dropped\\n')
        os.write(2, b'[W reducer.cpp:1360] Warning: dropped too\\n')
        os.write(2, b'[E1130 15:27:58.4 ProcessGroupGloo.cpp:1] an error, kept\\n')
        os.write(2, b'Traceback (most recent call last): kept\\n')
        os.write(2, b'a long line, kept ' + b'x' * 200000 + b'\\n')
        print('python stderr, kept', file=sys.stderr, flush=True)
        os.write(2, b'no newline at the end, kept')

    with native_warnings_dropped(active=sys.argv[1] == 'on'):
        lines()
        with native_warnings_dropped():  # nested: the outer one filters
            os.write(2, b'\\n[W1130 00:00:00.0 x.cpp:1] Warning: nested, dropped\\n')
    os.write(2, b'\\n[W1130 00:00:00.0 x.cpp:1] Warning: after the block, kept\\n')
""")


def run(mode):
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, timeout=60, check=True
    ).stderr


def test_warning_lines_are_dropped_and_everything_else_kept():
    err = run("on")
    assert b"dropped" not in err
    for kept in (
        b"an error, kept",
        b"Traceback (most recent call last): kept",
        b"python stderr, kept",
        b"no newline at the end, kept",
        b"after the block, kept",
    ):
        assert kept in err
    assert b"x" * 200000 in err


@pytest.mark.parametrize("ending", ["os.abort()", "os._exit(3)"])
def test_the_last_words_of_a_rank_that_dies_in_the_block_arrive(ending):
    script = textwrap.dedent(f"""
        import os
        from accel_mixin.native_output import native_warnings_dropped
        with native_warnings_dropped():
            os.write(2, b'[W1130 00:00:00.0 x.cpp:1] Warning: dropped\\n')
            os.write(2, b'terminate called after throwing an instance of ...\\n')
            os.write(2, b'the last words, without a newline')
            {ending}
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=60, check=False
    )
    assert out.returncode != 0
    assert b"terminate called after throwing" in out.stderr
    assert out.stderr.endswith(b"the last words, without a newline")
    assert b"dropped" not in out.stderr


def test_inactive_blocks_change_nothing():
    err = run("off")
    assert b"Warning: dropped\n" in err and b"nested, dropped" not in err


@pytest.mark.parametrize(
    "line, warning",
    [
        (b"[rank1]:[W1130 15:27:58.469831308 reducer.cpp:1529] Warning: x", True),
        (b"[W1130 15:27:58.469831308 socket.cpp:469] [c10d] waitForInput", True),
        (b"[W reducer.cpp:1360] Warning: x", True),
        (b"[E1130 15:27:58.4 ProcessGroupGloo.cpp:1] x", False),
        (b"[rank1]: Traceback (most recent call last):", False),
        (b"Warning: a plain line", False),
        (b"[Webpage] something", False),
    ],
)
def test_what_counts_as_a_native_warning(line, warning):
    assert is_native_warning(line) is warning
