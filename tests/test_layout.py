"""The package's layers depend on each other in one direction only.

A module imports from its own layer or the layers below it, never above:
a fit's path runs down from the net through these layers
(docs/guide/architecture.md, "The lifecycle"), and a subpackage can be read without those above it.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "accel_mixin"

# top first; a module belongs to the first layer that names it or its
# subpackage (the net's own modules are the package net/, in the top layer)
LAYERS = [
    {"__init__", "__main__", "net", "callbacks", "diagnostics"},
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


# The net's private attributes are read in the top layer only: below it,
# functions get the objects they use as parameters (a Fit, NetObjects, a
# Control) and return values, and never reach into the net's process-local holder.
HOLDER_MODULES = {"net.local"}  # NetLocal's


def _module(path):
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _top_private_names():
    """The private names the top layer's modules (net/ among them) define on
    the net (methods, properties)."""
    names = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if layer(_module(path)) != 0:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and _private(item.name):
                        names.add(item.name)
    return names


def _private(name):
    return name.startswith("_") and not name.endswith("__")


def _is_net(node):
    """``net`` or ``self.net``."""
    if isinstance(node, ast.Name):
        return node.id == "net"
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "net"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _mixed_into_the_net(cls):
    """A class below the top layer that is mixed into the net (``StepMixin(_Net)``)."""
    return any(isinstance(base, ast.Name) and base.id == "_Net" for base in cls.bases)


def private_reads():
    """``module: expression`` of every read of the net's private attributes
    below the top layer, and every import of the holder's module there."""
    top_names = _top_private_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        if layer(module) == 0:
            continue
        tree = ast.parse(path.read_text())
        found += [f"{module} imports {i}" for i in imports(path) if i in HOLDER_MODULES]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and _is_net(node.value):
                found.append(f"{module}: {ast.unparse(node)}")
            elif isinstance(node, ast.ClassDef) and _mixed_into_the_net(node):
                # the net's own private attributes, read by a class mixed into it
                for inner in ast.walk(node):
                    if (
                        isinstance(inner, ast.Attribute)
                        and isinstance(inner.value, ast.Name)
                        and inner.value.id == "self"
                        and inner.attr in top_names
                    ):
                        found.append(f"{module}: {ast.unparse(inner)}")
    return sorted(set(found))


def test_only_the_net_reads_its_private_attributes():
    assert private_reads() == []


def test_the_check_sees_a_private_read(tmp_path, monkeypatch):
    below = tmp_path / "accel_mixin" / "training"
    below.mkdir(parents=True)
    (tmp_path / "accel_mixin" / "net").mkdir()
    for path in PACKAGE.rglob("*.py"):  # the top layer's names
        if layer(_module(path)) == 0:
            (tmp_path / "accel_mixin" / path.relative_to(PACKAGE)).write_text(path.read_text())
    (below / "x.py").write_text(
        "from accel_mixin.net.local import NetLocal\n"
        "def f(net):\n    return net._local, net.__class__\n"
        "class M(_Net):\n    def g(self):\n        return self.net._objects, self._unwrapped()\n"
    )
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "accel_mixin")
    assert private_reads() == [
        "training.x imports net.local",
        "training.x: net._local",
        "training.x: self._unwrapped",
        "training.x: self.net._objects",
    ]
