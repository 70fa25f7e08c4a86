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
import json
import os
import re
import subprocess
import sys

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


# ---------------------------------------------------------------------------------------------- the Quick start
#: runs the README's Quick start as pasted (``quick_start.py``), then writes what its seeded run recorded
_STORY = """
import json, runpy

run = runpy.run_path("quick_start.py")
history = run["trainer"].precision_plugin.history
with open("story.json", "w") as f:
    json.dump({"curve": history.curve(), "skipped": history.skipped_steps}, f)
"""


def _readme_block(readme, heading, lang):
    start = readme.index(f"```{lang}\n", readme.index(heading)) + len(f"```{lang}\n")
    return readme[start : readme.index("```", start)]


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The README's Quick start, run as pasted on the CPU: its output and what its history recorded."""
    readme = _read(os.path.join(ROOT, "README.md"))
    where = tmp_path_factory.mktemp("quick_start")
    (where / "quick_start.py").write_text(_readme_block(readme, "## Quick start", "python"))
    (where / "story.py").write_text(_STORY)
    done = subprocess.run(
        [sys.executable, "story.py"],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=300,
        # the CPU run the README shows; a mutation-testing run's stats mode stays in its own process
        env={
            **{k: v for k, v in os.environ.items() if k != "MUTANT_UNDER_TEST"},
            "PYTHONPATH": ROOT,
            "CUDA_VISIBLE_DEVICES": "",
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    story = json.loads((where / "story.json").read_text())
    return readme, done, story, where


def _on_the_readmes_stack(readme):
    """What the README says its seeded run printed holds on the stack it names (float16 arithmetic is the stack's)."""
    import lightning
    import torch

    torch_version, lightning_version = re.search(
        r"What it printed on .*?\(torch ([^,]+), Lightning ([^;]+);", " ".join(readme.split())
    ).groups()
    if (torch.__version__, lightning.__version__) != (torch_version, lightning_version):
        pytest.skip(f"the README's run is torch {torch_version}, Lightning {lightning_version}")


def test_the_readme_quick_start_runs_as_pasted(quick_start):
    _, done, _, where = quick_start
    # it ends with the advisor's output: its header, then only its numbered findings and their fix lines
    lines = done.stderr.strip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("AmpAdvisor: "))
    assert all(re.match(r"(\d+\. \[\w+\] |    fix: )", line) for line in lines[header + 1 :]), lines[header:]
    assert "`NaNSkipReporter`: " in done.stderr  # the reporter's summary before it
    assert (where / "skips.json").exists()
    assert "AmpPlusWarning" not in done.stderr


def test_what_the_readme_says_its_quick_start_printed_is_what_it_prints(quick_start):
    readme, done, _, _ = quick_start
    _on_the_readmes_stack(readme)
    printed = _readme_block(readme[readme.index("## Quick start") :], "What it printed", "text")
    lines = {line.rstrip() for line in (done.stdout + done.stderr).splitlines()}
    for line in printed.strip().splitlines():
        assert line in lines, line


def test_the_readme_tells_its_quick_starts_curve_as_the_run_recorded_it(quick_start):
    """The prose around the Quick start: the curve it quotes, the skipped steps, where the scale stood and grew."""
    readme, _, story, _ = quick_start
    _on_the_readmes_stack(readme)
    text = readme[readme.index("## Quick start") : readme.index("## The parts")]
    prose = " ".join(text.split())
    curve = [tuple(point) for point in story["curve"]]
    quoted = re.search(r"history\.curve\(\)`[^`]*? is `(\[[^`]*\])`", prose).group(1)
    assert ast.literal_eval(quoted) == curve
    assert f"`.skipped_steps` holds the skipped updates (`{story['skipped']}`)" in prose
    (skip,) = story["skipped"]
    assert f"The skip at step {skip} is the initial scale meeting the gradients" in prose
    init = curve[0][1]
    assert f"initial 2^{int(init).bit_length() - 1}" in prose
    assert all(scale == init for step, scale in curve if step <= skip)  # no growth before the skip: no probing
    first_growth = next(step for (_, before), (step, after) in zip(curve, curve[1:], strict=False) if after > before)
    assert f"first grew at step {first_growth}" in prose
    interval = int(re.search(r"growth_interval=(\d+)", text).group(1))
    assert f"after `growth_interval={interval}` clean updates" in prose
    assert first_growth - (skip + 1) == interval  # the clean updates from the halved scale's first step


# ---------------------------------------------------------------------------------------------- figures
_HAND_TYPED = [
    # a count of Python calls, unless it is the bound a test holds ("at most 40 Python calls")
    re.compile(r"(?<!at most )(?<![\w.])[+-]?\d[\d,]*\s+(?:Python\s+)?calls\b"),
    re.compile(r"\b\d[\d,]*\s+passed\b"),  # a test count
]


@pytest.mark.parametrize(
    "page", ["README.md", *(os.path.relpath(p, ROOT) for p in glob.glob(f"{DOCS}/**/*.md", recursive=True))]
)
def test_no_page_types_a_count_by_hand(page):
    """Counts come from the command a page names (included at build time), or are not given."""
    if "_generated" in page:
        return
    text = " ".join(_read(os.path.join(ROOT, page)).split())
    for pattern in _HAND_TYPED:
        assert not pattern.findall(text), f"{page}: {pattern.findall(text)}"
    assert "| Python calls/step |" not in text  # the counts table is the command's output, never a copy


def _conf():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_conf", os.path.join(DOCS, "conf.py"))
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


def test_the_performance_page_includes_what_the_command_it_names_prints(monkeypatch, capsys):
    conf = _conf()
    command = " ".join(["python", *conf.COUNTS_COMMAND])
    page = " ".join(_read(os.path.join(DOCS, "performance.md")).split())
    assert command == "python examples/benchmark.py --size small --counts"
    assert f"`{command}`" in page
    assert f"```{{include}} {conf.COUNTS_PAGE} ```" in page
    # the build writes the command's own output: its header, every configuration's row, the differences
    from examples import benchmark

    table = benchmark.configs("cpu", "16-mixed", floor=True)
    per_step = {name: (1000 + 10 * i, 50 + i) for i, name in enumerate(table)}  # stand-in counts
    fits = iter(
        [fit for name in table for fit in ((1, 1), (200 * per_step[name][0] + 7, 200 * per_step[name][1] + 3), (7, 3))]
    )
    monkeypatch.setattr(benchmark, "count_fit", lambda *args: next(fits))  # warm-up, a 300-step fit, a 100-step fit
    benchmark.main(["--size", "small", "--counts"])
    markdown = conf.counts_markdown(capsys.readouterr().out)
    assert markdown.startswith(f"Printed by `{command}` when this site was built: ")
    for name, (calls, ops) in per_step.items():
        assert f"\n| {name} | {calls} | {ops} |\n" in markdown
    ours, floor = per_step["AmpPlusPrecision + callbacks"], per_step["stock AMP + 2 empty callbacks"]
    over = f"{ours[0] - floor[0]:+d} Python calls, {ours[1] - floor[1]:+d} aten ops a step"
    assert f"\n- AmpPlusPrecision + callbacks over stock AMP + 2 empty callbacks: {over}\n" in markdown


def test_the_advice_codes_table_is_the_rules_own():
    """Each advice code is declared once (`advice.RULES`): the advisor page's table is what the rules say of themselves.

    Regenerate it with `python -c "from lightning_amp_plus.advice import docs_table; print(docs_table())"`.
    """
    from lightning_amp_plus.advice import CODES, docs_table

    page = _read(os.path.join(DOCS, "guide", "advisor.md"))
    assert docs_table() in page
    headings = re.findall(r"^### `(\w+)`$", page, re.MULTILINE)
    assert headings == list(CODES)  # each code once, in the rules' order, and no other


def test_the_logger_sections_say_what_a_fresh_machine_needs():
    """A newcomer's frictions (issue 39): each logger's section says what its snippet needs to run there."""
    page = _read(os.path.join(DOCS, "guide", "curves.md"))
    sections = {s.split("\n", 1)[0]: s for s in page.split("\n## ")[1:]}
    assert "max_steps=" in sections["TensorBoard"]  # the snippet ends; without it, a fit runs 1000 epochs
    assert "pip install\nmlflow" in sections["MLflow"]  # `mlflow ui` is not in mlflow-skinny, the [test] extra's
    assert "mlflow==$(" in sections["MLflow"]  # at the version that wrote the database (a newer schema is refused)
    assert "offline=True" in sections["Weights & Biases"]  # no login: wandb asks for a key


def test_a_user_page_says_what_a_skip_line_means():
    page = _read(os.path.join(DOCS, "guide", "callbacks.md"))
    reading = page[page.index("**Reading a skip line**") :].split("\n\n**")[0]
    for words in ("step 412 skipped", "born in", "backward", "gradients non-finite in", "kept: with hysteresis"):
        assert words in reading, words


def test_the_first_page_says_each_line_the_package_prints_and_each_code():
    """`something-wrong.md` quotes what the package prints, made here by the code that prints it."""
    from lightning_amp_plus.advice import CODES
    from lightning_amp_plus.callbacks._skip_text import _held, collapse_message, describe_origin
    from lightning_amp_plus.forensics.origin import WATCHING

    page = " ".join(_read(os.path.join(DOCS, "guide", "something-wrong.md")).split())
    for code in CODES:
        assert f"**`{code}`**" in page, code
    for origin in (
        {"phase": "backward"},
        {"phase": "input"},
        {"phase": "forward", "module": None, "kind": "nan", "reason": WATCHING},
        {"phase": "forward", "module": "encoder.3.ff", "kind": "inf"},
        {"phase": "forward", "module": "attn", "kind": "nan", "fed_by": "bias"},
        {"phase": "loss"},
    ):
        assert f"`{describe_origin(origin)}`" in page, origin
    own = describe_origin({"phase": "forward", "module": "", "kind": "inf"})
    assert f"`{own.rsplit(' (', 1)[0]}`" in page  # its kind left out
    assert f"`loss scale 1 -> 1{_held(1.0, 1, 1.0)}`" in page
    assert f"`{_held(4.0, 2, 1.0).strip()}`" in page
    record = {"step": 16, "scale": 1.0, "offenders": []}
    at_floor = collapse_message(record, 17, 25, 1.0, None, (8, 17))
    assert f"`{at_floor.split(' (')[0]}`" in page
    assert "`Of the 17 skipped updates so far, 8 were born in the batch (inf/nan in the data)`" in page
    assert "Of the 17 skipped updates so far, 8 were born in the batch (inf/nan in the data)" in at_floor
    streak = collapse_message(record, 25, 25, None, None)
    assert f"`collapsed: {streak.split('collapsed: ')[1].split(';')[0]}`" in page


def test_ci_runs_the_readmes_two_commands():
    """The README's first command installs what running needs and runs the example; the second installs the test
    extra and runs the tests. `.ci/run`'s first leg runs exactly those installs and commands, in that order."""
    readme = _read(os.path.join(ROOT, "README.md"))
    setup = readme[readme.index("## Set up") : readme.index("## Quick start")]
    first, second = re.findall(r"```bash\n(.*?)\n```", setup, re.DOTALL)
    assert 'pip install -c requirements/ci-cpu.txt -e ".[plot]"' in first
    assert first.endswith("&& python examples/train_transformer.py")
    assert ".[test]" not in first  # running needs no test extra
    assert 'pip install -c requirements/ci-cpu.txt -e ".[test]"' in second
    assert second.endswith("&& python -m pytest -q")
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    leg = ci[ci.index("=== leg 1") : ci.index("=== leg 2")]
    steps = [
        'python -m pip install -c requirements/ci-cpu.txt -e ".[plot]"',
        'python "$repo/examples/train_transformer.py"',
        'python -m pip install -c requirements/ci-cpu.txt -e ".[test]"',
        "python -m pytest -q\n",
    ]
    positions = [leg.index(step) for step in steps]
    assert positions == sorted(positions)
