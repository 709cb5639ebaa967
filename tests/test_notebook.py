"""A notebook launch: ``examples/notebook.ipynb`` runs in a real Jupyter
kernel, where ``accelerate.notebook_launcher`` forks 2 processes that fit a
mixin net, and the notebook loads the weights they saved into plain skorch."""

import json
import subprocess
import sys

import pytest
from harness import ROOT, free_port
from jobs import kill_job  # scripts/jobs.py

NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
LAUNCH = "notebook_launcher(train, args=(X, y), num_processes=2)"

# run in a process of its own, so that a hang kills the kernel and the
# processes it forked together (kill_job) instead of outliving the test
EXECUTE = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
try:
    NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": sys.argv[2]}}).execute()
finally:
    nbformat.write(nb, sys.argv[3])
"""

# a train function whose rank 1 fails after the second epoch: by raising,
# or by ending its process
FAILING = """
import os
from skorch.callbacks import Callback


class Fail(Callback):
    def on_epoch_end(self, net, **kwargs):
        if net.accelerator.process_index == 1 and len(net.history) == 2:
            if HOW == "exit":
                os._exit(3)
            raise RuntimeError("rank 1 fails here")


def train(X, y):
    net = Net(Classifier, accelerator=Accelerator(cpu=True), max_epochs=8, callbacks=[Fail()])
    net.fit(X, y)
"""


def _cells(nb):
    return [(cell, "".join(cell["source"])) for cell in nb["cells"]]


def _execute(tmp_path, nb):
    """Run ``nb`` in a kernel in ``tmp_path``, its launch on a free port, where
    accelerate's default (29500) may be another launch's; the notebook as run."""
    launches = 0
    for cell, source in _cells(nb):
        launches += source.count(LAUNCH)
        cell["source"] = source.replace(LAUNCH, f'{LAUNCH[:-1]}, use_port="{free_port()}")')
    assert launches == 1, "the launch moved"
    given, executed = tmp_path / "given.ipynb", tmp_path / "executed.ipynb"
    given.write_text(json.dumps(nb))
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-c", EXECUTE, str(given), str(tmp_path), str(executed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        pytest.fail(f"the notebook ran past 300 s: {proc.communicate()[0]}")
    assert proc.returncode == 0, output
    return [
        cell for cell in json.loads(executed.read_text())["cells"] if cell["cell_type"] == "code"
    ]


def _outputs(cell, kind, name=None):
    return [
        out for out in cell["outputs"] if out["output_type"] == kind and out.get("name") == name
    ]


def _stream(cell, name):
    return "".join("".join(out["text"]) for out in _outputs(cell, "stream", name))


@pytest.mark.multiprocess
def test_notebook_launcher_fits_on_two_processes(tmp_path):
    code = _execute(tmp_path, json.loads(NOTEBOOK.read_text()))
    errors = [out for cell in code for out in _outputs(cell, "error")]
    assert not errors, json.dumps(errors, indent=1)
    launch = next(cell for cell in code if LAUNCH[:-1] in "".join(cell["source"]))
    stdout, stderr = _stream(launch, "stdout"), _stream(launch, "stderr")
    # both processes write to the cell: the log and the net's output come from one
    assert stdout.count("train_loss") == 1, stdout
    assert stdout.count("trained on 2 processes") == 1, stdout
    epochs = [line.split()[0] for line in stdout.splitlines() if line.strip()[:1].isdigit()]
    assert epochs == [str(epoch) for epoch in range(1, 9)], stdout
    assert "accel_mixin" not in stderr, stderr
    # the main process's file, in the notebook's folder, loaded by plain skorch
    assert (tmp_path / "notebook_params.pt").exists()
    accuracy = float(_stream(code[-1], "stdout").rsplit(" ", 1)[1])
    assert accuracy > 0.85, accuracy


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_rank_raises_in_the_cell(tmp_path, how):
    nb = json.loads(NOTEBOOK.read_text())
    setup = next(cell for cell, source in _cells(nb) if "class Net(" in source)
    failing = {
        "cell_type": "code",
        "metadata": {},
        "execution_count": None,
        "outputs": [],
        "source": f"HOW = {how!r}\n{FAILING}\n{LAUNCH}",
    }
    after = dict(failing, source="print('the kernel goes on')")
    nb["cells"] = [setup, failing, after]
    _, launch, last = _execute(tmp_path, nb)
    (error,) = _outputs(launch, "error")
    assert error["ename"] == "ChildFailedError", error
    if how == "raise":
        # the rank that waited names the failure of the other
        assert "on_epoch_end failed on rank 1: RuntimeError: rank 1 fails here" in error["evalue"]
    else:
        # the agent reports whichever it saw first: rank 1's exit, or rank 0
        # naming it
        seen = ("exitcode  : 3", "rank 1 is gone (its process ended)")
        assert any(text in error["evalue"] for text in seen), error["evalue"]
    assert _stream(last, "stdout") == "the kernel goes on\n"
