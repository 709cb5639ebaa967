"""The launch harness itself."""

import re
import socket

import prefork
import psutil
import pytest
from common import HUNG_STATUS
from harness import free_port, port_block, run_processes


@pytest.mark.multiprocess
@pytest.mark.parametrize("forked", [False, True], ids=["torchrun", "forked"])
def test_a_hang_is_killed_and_shows_every_rank(forked):
    # long enough for both ranks to start and print, beside a busy core
    fork = forked and prefork.usable(None)
    launch = run_processes("hang.py", timeout=8 if fork else 15, forked=forked)
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


@pytest.mark.multiprocess
@pytest.mark.parametrize("forked", [False, True], ids=["torchrun", "forked"])
def test_a_hung_check_ends_its_launch_at_its_own_deadline_naming_the_case(forked):
    launch = run_processes("hung_check.py", timeout=120, forked=forked)
    assert not launch.timed_out, "the launch ran to the harness's timeout"
    assert launch.returncode == 1  # torchrun's own status for any failed worker
    assert f"exitcode  : {HUNG_STATUS}" in launch.output, "no rank ended as hung"
    assert launch.hung == {0: ("stuck", 3), 1: ("stuck", 3)}
    for rank, report in enumerate(launch.ranks):
        assert report["checks"]["first"]["value"] == rank
        assert "after" not in report["checks"]
    assert "check 'stuck' hung on rank 1: no end within 3 s" in launch.describe()
    stderr = launch.rank_outputs[1][1]
    assert "hung: no end within 3 s" in stderr
    assert "in stuck" in stderr, "no stack of the hung check"
    with pytest.raises(pytest.fail.Exception, match="check 'stuck' hung on rank 0"):
        launch.check()


def test_ports_come_from_outside_the_ephemeral_range_one_block_per_worker():
    # an outgoing connection of another worker can never take them
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
        low = int(f.read().split()[0])
    first, stop = port_block({})
    assert stop <= low and free_port() in range(first, stop)
    blocks = [
        port_block({"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": "3"})
        for i in range(3)
    ]
    assert all(a[1] <= b[0] for a, b in zip(blocks, blocks[1:])) and blocks[-1][1] <= low


def test_free_port_never_returns_a_port_in_use():
    """Every port it returns can be listened on, on every interface as
    torchrun's rendezvous store listens; and while that listener holds it,
    as a running job's store does, it is never returned again."""
    held = []
    try:
        for _ in range(20):
            port = free_port()
            assert port not in [sock.getsockname()[1] for sock in held]
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("", port))  # OSError (address in use) if it was not free
            sock.listen()
    finally:
        for sock in held:
            sock.close()
