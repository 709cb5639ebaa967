"""scripts/dist_contents.py, the contents check of scripts/package-check,
passes the artifacts it should and names what is missing or extra."""

import tarfile
import zipfile

import dist_contents  # scripts/dist_contents.py
import pytest
from harness import ROOT

TOP = "accel_mixin-0.1.0"
DIST_INFO = f"{TOP}.dist-info"


def write_artifacts(tmp_path, drop=(), add=()):
    """A wheel and an sdist as setuptools builds them, less ``drop``, plus ``add``."""
    modules = sorted(dist_contents.package_modules())
    wheel_names = [*modules, f"{DIST_INFO}/METADATA", f"{DIST_INFO}/licenses/LICENSE"]
    sdist_names = [
        *modules,
        *dist_contents.SDIST_FILES,
        "accel_mixin.egg-info/PKG-INFO",
        "accel_mixin.egg-info/SOURCES.txt",
    ]
    wheel, sdist = tmp_path / f"{TOP}-py3-none-any.whl", tmp_path / f"{TOP}.tar.gz"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in wheel_names:
            if f"wheel:{name}" not in drop:
                zf.writestr(name, "")
        for name in add:
            if name.startswith("wheel:"):
                zf.writestr(name.removeprefix("wheel:"), "")
    with tarfile.open(sdist, "w:gz") as tf:
        for name in sdist_names + [a.removeprefix("sdist:") for a in add if a.startswith("sdist:")]:
            if f"sdist:{name}" not in drop:
                tf.addfile(tarfile.TarInfo(f"{TOP}/{name}"))
    return str(sdist), str(wheel)


def test_complete_artifacts_pass(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    dist_contents.main(*write_artifacts(tmp_path))
    assert "dist_contents.py: ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("drop", "add", "message"),
    [
        (
            ["wheel:accel_mixin/net/mixin.py"],
            [],
            "wheel accel_mixin-0.1.0-py3-none-any.whl lacks accel_mixin/net/mixin.py",
        ),
        (
            ["wheel:accel_mixin-0.1.0.dist-info/licenses/LICENSE"],
            [],
            "lacks LICENSE in its dist-info",
        ),
        ([], ["wheel:tests/test_mixin.py"], "holds tests/test_mixin.py, which it should not"),
        ([], ["wheel:accel_mixin/deleted.py"], "holds accel_mixin/deleted.py, which it should not"),
        (["sdist:LICENSE"], [], "sdist accel_mixin-0.1.0.tar.gz lacks LICENSE"),
        (
            ["sdist:accel_mixin/net/mixin.py"],
            [],
            "sdist accel_mixin-0.1.0.tar.gz lacks accel_mixin/net/mixin.py",
        ),
        ([], ["sdist:tests/test_mixin.py"], "holds tests/test_mixin.py, which it should not"),
    ],
)
def test_missing_or_extra_files_fail_by_name(tmp_path, monkeypatch, capsys, drop, add, message):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        dist_contents.main(*write_artifacts(tmp_path, drop, add))
    assert "git add" in str(exit_.value)
    assert message in capsys.readouterr().err
