"""Sphinx configuration: the user guide (Markdown, MyST) and the API reference (autodoc, Google docstrings).

Build (warnings are errors, as in CI): ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

from lightning_amp_plus.__about__ import __version__  # noqa: E402

project = "lightning-amp-plus"
author = "lightning-amp-plus developers"
copyright = "2026, lightning-amp-plus developers"
version = release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]

# MyST: GitHub-style heading anchors (`page.md#set-up`), `:::` fences for directives
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# autodoc + napoleon: Google docstrings, signatures as written, members in source order
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # Lightning's hooks (`@override`, no docstring of their own) are documented upstream
autodoc_default_options = {"members": True}
# the package's docstrings hold doctested `Example:` blocks; their `>>>` prompts render as code
add_module_names = False

html_theme = "furo"
html_title = f"lightning-amp-plus {release}"
