"""Sphinx configuration of the accel_mixin documentation.

Built by ``scripts/docs`` with warnings as errors and nitpicky references
(``sphinx-build -W --keep-going -n``). The build needs no network: there is
no intersphinx, so the docstrings name other projects' objects as literals
(````accelerate.Accelerator````), not as references. The code's type hints
(checked by ``scripts/typecheck``) name such objects too, so the signatures
show none: the numpydoc sections give the types.
"""

import sys
from pathlib import Path

# document this checkout's package, whatever copy the environment has installed
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import accel_mixin  # noqa: E402

project = "accel_mixin"
author = "the accel_mixin authors"
copyright = "the accel_mixin authors; BSD-3-Clause"
release = accel_mixin.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

html_theme = "alabaster"
html_title = f"accel_mixin {release}"
html_theme_options = {"description": "skorch nets trained with HuggingFace Accelerate"}

# autodoc: members in source order; no type hints (they would refer to
# skorch's, torch's and accelerate's objects, which the offline build cannot)
autodoc_member_order = "bysource"
autodoc_typehints = "none"

# numpydoc: the sections it renders are the reference; no autosummary tables
# of every inherited skorch method
numpydoc_show_class_members = False
numpydoc_show_inherited_class_members = False
numpydoc_class_members_toctree = False

# MyST: headings get anchors, so that guide pages can link to sections
myst_heading_anchors = 3
