"""An Accelerator carried through pickle as settings."""

import copy
import pickle
import subprocess
import sys

import pytest
from accelerate import Accelerator
from common import AcceleratedNet
from conftest import reset_accelerate
from harness import LAUNCHED, ROOT

from accel_mixin.training.portable import (
    PortableAccelerator,
    accelerator_settings,
    build_accelerator,
)


def test_settings_rebuild_the_accelerator():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=3)
    rebuilt = build_accelerator(accelerator_settings(accelerator))
    assert rebuilt.mixed_precision == "bf16"
    assert rebuilt.gradient_accumulation_steps == 3
    assert rebuilt.device.type == "cpu"


def test_deepcopy_keeps_the_accelerator():
    accelerator = Accelerator(cpu=True)
    assert copy.deepcopy(PortableAccelerator(accelerator)) is accelerator


def test_pickle_gives_a_fresh_accelerator_on_the_live_state():
    accelerator = Accelerator(cpu=True)
    accelerator._dataloaders.extend(range(100))  # stale state must not travel
    restored = pickle.loads(pickle.dumps(PortableAccelerator(accelerator)))
    assert isinstance(restored, Accelerator) and restored is not accelerator
    # a plainly pickled accelerator would bring private copies of both
    assert restored.gradient_state.__dict__ is accelerator.gradient_state.__dict__
    assert restored.state.__dict__ is accelerator.state.__dict__


def test_settings_the_live_state_cannot_take_fall_back_with_a_warning():
    settings = accelerator_settings(Accelerator(cpu=True, mixed_precision="bf16"))
    reset_accelerate()
    Accelerator(cpu=True, mixed_precision="no")
    settings["mixed_precision"] = "bf16"
    with pytest.warns(RuntimeWarning, match="mixed_precision='bf16'"):
        rebuilt = build_accelerator(settings)
    assert rebuilt.mixed_precision == "no"


UNPICKLE = """
import pickle, sys
net = pickle.load(open(sys.argv[1], 'rb'))
X = pickle.load(open(sys.argv[2], 'rb'))
print(net.accelerator.mixed_precision, len(net.predict(X)), net.predict_proba(X).sum())
"""


def test_unpickle_in_a_fresh_process(mlp, data, tmp_path):
    net = AcceleratedNet(
        mlp, accelerator=Accelerator(cpu=True, mixed_precision="bf16"), max_epochs=1, verbose=0
    )
    net.fit(*data)
    X = data[0][:77]
    (tmp_path / "net.pkl").write_bytes(pickle.dumps(net))
    (tmp_path / "X.pkl").write_bytes(pickle.dumps(X))
    out = subprocess.run(
        [sys.executable, "-c", UNPICKLE, str(tmp_path / "net.pkl"), str(tmp_path / "X.pkl")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": f"{ROOT}:{LAUNCHED}", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    precision, rows, total = out.stdout.split()
    assert (precision, int(rows)) == ("bf16", 77)
    assert float(total) == pytest.approx(net.predict_proba(X).sum(), rel=1e-5)
