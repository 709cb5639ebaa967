"""The launch harness itself."""
import psutil
import pytest

from harness import free_port, run_processes

pytestmark = pytest.mark.multiprocess


def test_a_hang_is_killed_and_shows_every_rank():
    launch = run_processes('hang.py', timeout=15)
    assert launch.timed_out
    assert '[default0]:rank 0 started' in launch.output
    assert '[default1]:rank 1 started' in launch.output
    with pytest.raises(pytest.fail.Exception, match='timed out'):
        launch.check()
    left = [p for p in psutil.process_iter(['cmdline'])
            if any('hang.py' in part for part in p.info['cmdline'] or [])]
    assert not left, 'workers outlived the launch'


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', port))
