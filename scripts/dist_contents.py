"""Check what the sdist and the wheel hold, for scripts/package-check.

The wheel holds the accel_mixin package (every module of the source tree,
nothing else) and its dist-info with LICENSE; no tests, scripts or examples.
The sdist holds the package, LICENSE, README.md (the long description),
setup.cfg, pyproject.toml and what setuptools adds (PKG-INFO, the egg-info).
Run from the repository root, whose accel_mixin/ is what the artifacts must
hold: python scripts/dist_contents.py SDIST WHEEL
"""

import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "accel_mixin"
SDIST_FILES = {"LICENSE", "MANIFEST.in", "README.md", "setup.cfg", "pyproject.toml", "PKG-INFO"}


def package_modules():
    return {p.as_posix() for p in Path(PACKAGE).rglob("*.py") if "__pycache__" not in p.parts}


def compare(kind, have, expected, allowed_extra=lambda name: False):
    """Describe what ``have`` lacks of ``expected`` and holds beyond it."""
    problems = [f"{kind} lacks {name}" for name in sorted(expected - have)]
    problems += [
        f"{kind} holds {name}, which it should not"
        for name in sorted(have - expected)
        if not allowed_extra(name)
    ]
    return problems


def check_wheel(path, modules):
    names = {n for n in zipfile.ZipFile(path).namelist() if not n.endswith("/")}
    dist_info = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    problems = compare(f"the wheel {path.name}", names - dist_info, modules)
    if not any(n.rsplit("/", 1)[-1] == "LICENSE" for n in dist_info):
        problems.append(f"the wheel {path.name} lacks LICENSE in its dist-info")
    return problems


def check_sdist(path, modules):
    with tarfile.open(path) as tar:
        members = [m.name for m in tar.getmembers() if m.isfile()]
    top = members[0].split("/")[0]
    names = {m.split("/", 1)[1] for m in members if "/" in m}
    return compare(
        f"the sdist {path.name}",
        names,
        modules | SDIST_FILES,
        allowed_extra=lambda name: name.startswith(f"{PACKAGE}.egg-info/"),
    ) + [f"the sdist {path.name} holds {m} outside {top}/" for m in members if "/" not in m]


def main(sdist, wheel):
    modules = package_modules()
    if not modules:
        sys.exit(f"dist_contents.py: no {PACKAGE}/*.py here; run it from the repository root")
    problems = check_sdist(Path(sdist), modules) + check_wheel(Path(wheel), modules)
    for problem in problems:
        print(f"dist_contents.py: {problem}", file=sys.stderr)
    if problems:
        sys.exit(
            "dist_contents.py: the artifacts are built from git's tracked files: a module that "
            "is missing may need `git add`; setup.cfg (packages, license_files) and MANIFEST.in "
            "decide the rest, and SDIST_FILES here lists what the sdist may hold"
        )
    print(
        f"dist_contents.py: ok: the {len(modules)} modules in both, LICENSE in the wheel's "
        f"dist-info, {', '.join(sorted(SDIST_FILES))} in the sdist"
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/dist_contents.py SDIST WHEEL")
    main(*sys.argv[1:])
