"""Sphinx configuration: the user guide (Markdown, MyST) and the API reference (autodoc, Google docstrings).

Build (warnings are errors, as in CI): ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

import glob
import os
import subprocess
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
exclude_patterns = ["_build", "_generated"]  # _generated: pages include its files

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


# ---------------------------------------------------------------------------------------------- generated figures
#: the command whose output the Performance page includes (its "Python calls per step" table), run at build time
#: so the page shows what the code does now; deterministic counts, so a rebuild of unchanged code gives the same
COUNTS_COMMAND = ["examples/benchmark.py", "--size", "small", "--counts"]
COUNTS_PAGE = os.path.join("_generated", "counts.md")


def _write_counts(app):
    """Run :data:`COUNTS_COMMAND` and write its output as Markdown (about 30 s; again only when code changed)."""
    root = os.path.dirname(app.srcdir)
    out = os.path.join(app.srcdir, COUNTS_PAGE)
    sources = [
        os.path.join(root, COUNTS_COMMAND[0]),
        *glob.glob(os.path.join(root, "lightning_amp_plus", "**", "*.py"), recursive=True),
    ]
    if os.path.isfile(out) and os.path.getmtime(out) > max(os.path.getmtime(s) for s in sources):
        return
    done = subprocess.run(
        [sys.executable, *COUNTS_COMMAND],
        cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(counts_markdown(done.stdout))


def counts_markdown(printed):
    """The counts command's output as Markdown: its header line as a caption, the table, the differences as a list."""
    lines = [line for line in printed.splitlines() if line.strip()]
    header = [line[2:] for line in lines if line.startswith("# ")]
    table = [line for line in lines if line.startswith("|")]
    rest = [f"- {line}" for line in lines if not line.startswith(("# ", "|"))]
    command = " ".join(["python", *COUNTS_COMMAND])
    caption = f"Printed by `{command}` when this site was built: {header[0]}" if header else command
    return "\n".join([caption, "", *table, "", *rest, ""])


def setup(app):
    """Generate the included figures before the pages are read."""
    app.connect("builder-inited", _write_counts)
