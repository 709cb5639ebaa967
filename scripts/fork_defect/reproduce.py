"""Whether this Python has the fork defect ``distributed/fork_guard.py`` guards.

python/cpython#112275: a forked child takes the lock of the interpreter's
list of thread states in ``os.fork`` itself; if another thread held it at
the fork, the child waits forever. ``gilspin``'s native threads take it
without the GIL, as torch's communication threads do, in a tight loop; the
main thread forks, each child starts a thread and exits, and a child still
running after ``--wait`` seconds is counted as hung and killed.

    scripts/fork_defect/run PYTHON...    (builds gilspin for each, then runs this)

Measured on 2026-12-05 (2 cores, 4 native threads, 2,000 forks): 34 children
hung on 3.9.18, 45 on 3.10.13, 39 on 3.11.7; none on 3.12.1 and 3.13.0, nor
in 5,000 forks with 8 threads. ``fork_guard.needed()`` says the same.
"""

import argparse
import os
import signal
import sys
import threading
import time


def child():
    try:
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()
    finally:
        os._exit(0)


def hung_after(pid, wait):
    """Whether child ``pid`` is still running after ``wait`` seconds (then killed)."""
    deadline = time.monotonic() + wait
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return True
        time.sleep(0.001)
    return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--forks", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=120, help="stop forking after this")
    parser.add_argument("--wait", type=float, default=2.0)
    parser.add_argument("--gilspin", required=True, help="the folder of the built gilspin")
    args = parser.parse_args()
    sys.path.insert(0, args.gilspin)
    import gilspin  # pylint: disable=import-outside-toplevel,import-error

    gilspin.start(args.threads)
    sys.setswitchinterval(1e-5)
    start = time.monotonic()
    forks = hung = 0
    while forks < args.forks and time.monotonic() - start < args.seconds:
        pid = os.fork()
        if pid == 0:
            child()
        hung += hung_after(pid, args.wait)
        forks += 1
    version = sys.version.split()[0]
    print(f"python {version}: {hung} of {forks} children hung ({time.monotonic() - start:.1f} s)")
    sys.stdout.flush()
    os._exit(0)  # the native threads hold thread states; no finalization


if __name__ == "__main__":
    main()
