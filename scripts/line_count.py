"""The size of each subsystem of accel_mixin/: each subpackage and each
top-level module, in lines, for the working tree or a git ref, and beside
another ref with the difference. scripts/lines runs it.

``lines`` counts every line of the ``.py`` files; ``code`` leaves out blank
lines, comments and docstrings, so that a change in prose does not read as
a change in machinery. A ref is read from git's objects (``git ls-tree`` and
``git cat-file``), without a checkout, so the working tree is never touched.

Usage: scripts/lines [--at REF] [--base REF]
"""

import argparse
import ast
import io
import subprocess
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "accel_mixin"
# tokens that carry no code of their own
LAYOUT = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


def code_lines(source):
    """The number of lines holding code: not blank, not only a comment, not
    part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = body[0] if body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in LAYOUT:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def subsystem(path):
    """``training/`` for ``accel_mixin/training/epochs.py``, ``callbacks.py`` for
    ``accel_mixin/callbacks.py``."""
    parts = Path(path).relative_to(PACKAGE).parts
    return f"{parts[0]}/" if len(parts) > 1 else parts[0]


def sources_in_tree():
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def git(*args, stdin=None):
    done = subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, check=False)
    if done.returncode:
        sys.exit(f"scripts/lines: git {' '.join(args)} failed: {done.stderr.decode().strip()}")
    return done.stdout


def sources_at(ref):
    """Every ``.py`` file of the package at ``ref``, read in one ``git
    cat-file --batch``."""
    listing = git("ls-tree", "-r", ref, "--", f"{PACKAGE}/").decode().splitlines()
    blobs = []
    for line in listing:
        meta, path = line.split("\t", 1)
        if meta.split()[1] == "blob" and path.endswith(".py"):
            blobs.append((meta.split()[2], path))
    if not blobs:
        sys.exit(f"scripts/lines: {ref} holds no {PACKAGE}/*.py")
    out = io.BytesIO(git("cat-file", "--batch", stdin="".join(f"{b}\n" for b, _ in blobs).encode()))
    for _, path in blobs:
        size = int(out.readline().split()[2])
        yield path, out.read(size).decode("utf-8")
        out.read(1)  # the newline after each object


def count(sources):
    """{subsystem: [files, lines, code]}, with ``total``."""
    sizes = defaultdict(lambda: [0, 0, 0])
    for path, source in sources:
        for key in (subsystem(path), "total"):
            sizes[key][0] += 1
            sizes[key][1] += len(source.splitlines())
            sizes[key][2] += code_lines(source)
    return sizes


def order(keys):
    """Subpackages first, then modules, each alphabetically; the total last."""
    named = sorted(k for k in keys if k != "total")
    return [k for k in named if k.endswith("/")] + [k for k in named if not k.endswith("/")]


def change(new, old):
    if not old:
        return "new"
    return f"{new - old:+d} ({(new - old) / old:+.1%})"


def table(now, label, base=None, base_label=None):
    if base is None:
        rows = [["subsystem", "files", "lines", "code"]]
        rows += [[k, *map(str, now[k])] for k in [*order(now), "total"]]
    else:
        rows = [["subsystem", f"lines {base_label}", f"lines {label}", "change"]]
        rows[0] += [f"code {base_label}", f"code {label}", "change"]
        for k in [*order(set(now) | set(base)), "total"]:
            old, new = base.get(k, [0, 0, 0]), now.get(k, [0, 0, 0])
            rows.append([k, str(old[1]), str(new[1]), change(new[1], old[1])])
            rows[-1] += [str(old[2]), str(new[2]), change(new[2], old[2])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])
        for r in rows
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", help="count this git ref instead of the working tree")
    parser.add_argument("--base", help="a git ref to count beside it, with the difference")
    args = parser.parse_args(argv)
    now = count(sources_at(args.at) if args.at else sources_in_tree())
    label = args.at or "tree"
    base = count(sources_at(args.base)) if args.base else None
    print(table(now, label, base, args.base))


if __name__ == "__main__":
    main()
