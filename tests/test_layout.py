"""The package's layers depend on each other in one direction only.

A module imports from its own layer or the layers below it, never above:
a fit's path runs down from the net through these layers
(docs/guide/architecture.md, "The lifecycle"), and a subpackage can be read without those above it.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "accel_mixin"

# top first; a module not in a subpackage belongs to the first layer that
# names it
LAYERS = [
    {"__init__", "__main__", "net", "callbacks", "checkpointing", "diagnostics"},
    {"resume"},
    {"training"},
    {"checkpoint"},
    {"distributed"},
    {"internals", "errors"},
]


def layer(module):
    """The layer of ``accel_mixin.<module>`` (a dotted path below the package)."""
    head = module.split(".")[0]
    for depth, names in enumerate(LAYERS):
        if head in names:
            return depth
    raise AssertionError(f"accel_mixin.{module} is in no layer: add it to LAYERS")


def imports(path):
    """The accel_mixin modules that ``path`` imports, as dotted paths below the package."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "accel_mixin":
                yield from (alias.name for alias in node.names)
            elif node.module.startswith("accel_mixin."):
                yield node.module.removeprefix("accel_mixin.")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("accel_mixin."):
                    yield alias.name.removeprefix("accel_mixin.")


def upward_imports():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for imported in imports(path):
            if layer(imported) < layer(module):
                found.append(f"{module} imports {imported}")
    return found


def test_every_module_imports_only_its_own_layer_or_those_below():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(monkeypatch):
    # the check is no tautology: a layer order turned upside down breaks it
    monkeypatch.setattr(__import__(__name__), "LAYERS", LAYERS[::-1])
    assert upward_imports()
