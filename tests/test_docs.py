"""The documentation is the code's: every argument the user guide documents exists, with the default it gives.

The knobs live in the user guide (``docs/guide/*.md``) under headings like
``## `LossScaleMonitor(logging_interval=None, prefix="amp/", progress_bar=True)` ``; the plugin's keyword-only knobs
in the table under its heading. Defaults are compared with ``inspect.signature`` and with what a built object holds
(a default of ``None`` in the signature that the constructor replaces, as the plugin's scaler knobs, is documented
as the value in force). README.md is a front page: its links must lead somewhere.
"""

import ast
import glob
import inspect
import os
import re

import pytest

import lightning_amp_plus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
GUIDE = sorted(glob.glob(os.path.join(DOCS, "guide", "*.md")))


def _read(path):
    with open(path) as f:
        return f.read()


HEADINGS = [
    (os.path.relpath(page, DOCS), name, signature)
    for page in GUIDE
    for name, signature in re.findall(r"^#{2,3} `(\w+)\((.*)\)`$", _read(page), re.MULTILINE)
]
IDS = [name for _, name, _ in HEADINGS]


def _arguments(cls):
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD}


def _documented(signature):
    call = ast.parse(f"f({signature})", mode="eval").body
    return {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}


def test_every_public_class_with_arguments_has_one_heading():
    assert GUIDE, "no user-guide pages found under docs/guide/"
    names = [name for _, name, _ in HEADINGS]
    expected = {"AmpPlusPrecision", "LossScaleMonitor", "NaNSkipReporter", "PrecisionReport"}
    assert expected | {"GradUnderflowMonitor", "AmpAdvisor"} <= set(names)
    assert len(names) == len(set(names)), names  # each documented in one place


@pytest.mark.parametrize(("page", "name", "signature"), HEADINGS, ids=IDS)
def test_each_heading_gives_the_arguments_and_defaults_of_the_code(page, name, signature):
    shown = signature.replace(", *, ...", "")  # the plugin's keyword-only knobs are in its table
    documented = _documented(shown)
    actual = _arguments(getattr(lightning_amp_plus, name))
    if shown == signature:
        assert documented == actual, page  # every argument, each with its default
    else:
        assert documented == {k: actual[k] for k in documented}, page


def test_the_plugins_table_gives_every_knob_and_its_default():
    text = _read(os.path.join(DOCS, "guide", "plugin.md"))
    start = text.index("### `AmpPlusPrecision(")
    table = text[start : text.index("\n#", start + 1)]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.MULTILINE))
    plugin = lightning_amp_plus.AmpPlusPrecision()
    in_force = plugin.scaler.knobs()  # read from what was built, not only from the signature
    in_force.update(
        precision=plugin.precision,
        device=plugin.device,
        skip_nonfinite=plugin.skip_nonfinite,
        skip_scheduler_on_overflow=plugin.skip_scheduler_on_overflow,
        warn_skip_streak=plugin.engine.warn_skip_streak,
    )
    declared = _arguments(lightning_amp_plus.AmpPlusPrecision)
    assert set(rows) == set(declared)
    for knob, default in rows.items():
        value = eval(default, {"__builtins__": {}})  # literals and powers such as 2.0**16
        if declared[knob] is not None or knob not in in_force:
            assert declared[knob] == value, f"{knob}: the signature's default is {declared[knob]!r}"
        if knob in in_force:
            assert in_force[knob] == value, f"{knob}: the plugin holds {in_force[knob]!r}"


CALLBACKS = [(page, name, signature) for page, name, signature in HEADINGS if name != "AmpPlusPrecision"]


@pytest.mark.parametrize(("page", "name", "signature"), CALLBACKS, ids=[name for _, name, _ in CALLBACKS])
def test_each_callback_built_without_arguments_holds_the_defaults_its_heading_gives(page, name, signature):
    """Read from what was built: a signature can show a default that the constructor does not use."""
    documented = _documented(signature)
    built = getattr(lightning_amp_plus, name)()
    assert {knob: getattr(built, knob) for knob in documented} == documented, page


def _anchors(text):
    """A Markdown page's link targets: MyST labels ``(name)=`` and GitHub-style heading slugs."""
    labels = set(re.findall(r"^\((\S+)\)=$", text, re.MULTILINE))
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        labels.add(slug)
    return labels


@pytest.mark.parametrize(
    "page", ["README.md", *(os.path.relpath(p, ROOT) for p in glob.glob(f"{DOCS}/**/*.md", recursive=True))]
)
def test_relative_links_lead_to_a_file_and_an_anchor_there(page):
    text = _read(os.path.join(ROOT, page))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        assert os.path.isfile(file), f"{page}: {target} leads nowhere"
        if anchor:
            assert anchor in _anchors(_read(file)), f"{page}: {target}: no such anchor"


def test_the_readme_is_a_front_page():
    readme = _read(os.path.join(ROOT, "README.md"))
    assert len(readme.splitlines()) < 300
    for heading in ("## Set up", "## Quick start", "## The parts"):
        assert f"\n{heading}\n" in readme
    assert "_batches_that_stepped" not in readme  # user text names no private attribute
    quick_start = readme[readme.index("## Quick start") : readme.index("## The parts")]
    assert "AmpAdvisor()" in quick_start
    assert "\nAmpAdvisor: " in quick_start  # and shows what it printed
