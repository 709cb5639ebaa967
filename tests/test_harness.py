"""The launch harness itself."""

import re

import psutil
import pytest
from harness import free_port, run_processes

pytestmark = pytest.mark.multiprocess


def test_a_hang_is_killed_and_shows_every_rank():
    launch = run_processes("hang.py", timeout=20)
    assert launch.timed_out
    pids = [
        int(pid)
        for pid in re.findall(r"\[default[01]\]:rank [01] started as pid (\d+)", launch.output)
    ]
    assert len(pids) == 2, launch.output
    with pytest.raises(pytest.fail.Exception, match="timed out"):
        launch.check()
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    assert not alive, "workers outlived the launch"


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
