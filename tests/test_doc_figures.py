"""The documentation's pictures are drawn from their seeded runs, as those runs go now.

``docs/_figures.py`` runs each picture's seeded CPU fit and draws its logged curves with the package's plot; each
PNG carries the curves it was drawn from, the stack and the CPU it ran on. Here each run is made again and compared
with what its picture carries: the series, not the pixels. A seeded run's float16 arithmetic is the stack's and the
CPU's:

- another torch or Lightning, or other vector kernels (AVX2 and AVX512 round float16 apart: a loss 3% off after six
  steps): skipped, saying so (the pictures still have to be there and shown);
- the same stack on the CPU that drew them: equal, floats to 1e-9;
- the same stack on another CPU (two AVX512 CPUs were seen 0.07% apart in a headroom figure): the run's course
  (steps, skips, scale values) equal and its measured floats to :data:`OTHER_CPU`; a course this CPU takes elsewhere
  is skipped, saying where.
"""

import glob
import importlib.util
import json
import math
import os
import re
from pathlib import Path

import pytest
from PIL import Image

from lightning_amp_plus.plot import read_series

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _figures_module():
    spec = importlib.util.spec_from_file_location("doc_figures", os.path.join(DOCS, "_figures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIGURES = _figures_module()


#: measured floats (loss, headroom, underflow) on another CPU than the pictures': float16 rounds apart there (0.07%
#: seen between two AVX512 CPUs); a stale picture moves its course or its floats by far more
OTHER_CPU = 1e-2


def _carried(name):
    with Image.open(os.path.join(FIGURES.FOLDER, f"{name}.png")) as image:
        text = image.text
        return json.loads(text[FIGURES.CURVES_KEY]), text[FIGURES.STACK_KEY], text.get(FIGURES.MACHINE_KEY)


class OtherCourse(AssertionError):
    """The run's course (a step, a skip, a scale value) differs: on another CPU, float16 took it elsewhere."""


def _same(drawn, now, rel_tol=1e-9, path="curves"):
    """Equal: floats to ``rel_tol`` (1e-9: a value written to CSV and read back), the course exactly."""
    if isinstance(drawn, float) and isinstance(now, float) and not path.startswith("curves.scale"):
        assert math.isclose(drawn, now, rel_tol=rel_tol, abs_tol=1e-12), (path, drawn, now)
    elif isinstance(drawn, dict):
        assert drawn.keys() == now.keys(), path
        for key in drawn:
            _same(drawn[key], now[key], rel_tol, f"{path}.{key}")
    elif isinstance(drawn, list):
        if len(drawn) != len(now):
            raise OtherCourse((path, len(drawn), len(now)))
        for i, (a, b) in enumerate(zip(drawn, now, strict=True)):
            _same(a, b, rel_tol, f"{path}[{i}]")
    elif drawn != now:
        raise OtherCourse((path, drawn, now))


def compare(drawn, now, same_cpu):
    """None where ``now`` matches what a picture was ``drawn`` from, else why it is skipped; raises where it differs.

    On the CPU that drew it: exact. On another: floats to :data:`OTHER_CPU`; a course of its own is a skip.
    """
    if same_cpu:
        _same(drawn, now)
        return None
    try:
        _same(drawn, now, OTHER_CPU)
    except OtherCourse as where:
        return f"float16 on this CPU takes the seeded run another way ({where}); the drawing CPU compares it exactly"
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each picture's seeded run, made again: its curves and the keys its log holds."""
    made = {}
    for name, (_, run) in FIGURES.FIGURES.items():
        folder = tmp_path_factory.mktemp(name)
        curves = run(str(folder))
        made[name] = (json.loads(FIGURES.curves_json(curves)), set(read_series(folder)))
    return made


@pytest.mark.parametrize("name", list(FIGURES.FIGURES))
def test_each_picture_is_drawn_from_what_its_seeded_run_logs_now(runs, name):
    drawn, made_on, cpu = _carried(name)
    if made_on != FIGURES.stack():
        pytest.skip(f"the pictures were made on {made_on}, this is {FIGURES.stack()}")
    now, _ = runs[name]
    try:
        skipped = compare(drawn, now, same_cpu=cpu == FIGURES.machine())
    except AssertionError as error:
        raise AssertionError(
            f"docs/figures/{name}.png: {error}; redraw it with `python docs/_figures.py {name}`"
        ) from None
    if skipped:
        pytest.skip(f"docs/figures/{name}.png was drawn on {cpu}, this is {FIGURES.machine()}: {skipped}")


def test_another_cpu_compares_with_its_tolerance_and_the_drawing_cpu_exactly(runs):
    """A fresh clone on another CPU is never red for float16's rounding; a picture that is stale still is."""
    drawn = json.loads(json.dumps(runs["healthy"][0]))
    rounded = json.loads(json.dumps(drawn))
    rounded["headroom"][1][1] *= 1 + 7e-4  # what two AVX512 CPUs gave
    assert compare(drawn, rounded, same_cpu=False) is None
    with pytest.raises(AssertionError, match="headroom"):
        compare(drawn, rounded, same_cpu=True)
    stale = json.loads(json.dumps(drawn))
    stale["loss"][3][1] *= 1.05
    with pytest.raises(AssertionError, match="loss"):
        compare(drawn, stale, same_cpu=False)
    elsewhere = json.loads(json.dumps(drawn))
    elsewhere["skipped"][0] += 1
    assert "skipped" in compare(drawn, elsewhere, same_cpu=False)
    with pytest.raises(AssertionError, match="skipped"):
        compare(drawn, elsewhere, same_cpu=True)


def test_the_pictures_show_what_their_pages_say(runs):
    """What the captions claim of each run, read from the run."""
    names = ("healthy", "calibration", "collapse", "underflow")
    healthy, calibration, collapse, underflow = (runs[name][0] for name in names)
    scales = [v for _, v in healthy["scale"]]
    assert max(scales) > scales[0]  # the scale climbs, then saw-tooths: growths and backoffs alternate at its top
    assert sum(1 for a, b in zip(scales, scales[1:], strict=False) if b < a) >= 5
    assert len(healthy["skipped"]) < 0.05 * healthy["scale"][-1][0]  # a few percent of the updates
    assert max(v for _, v in healthy["underflow"]) < 0.01
    assert max(v for _, v in healthy["headroom"]) < 4
    first = calibration["scale"][0][1]
    assert calibration["skipped"][:8] == list(range(8))  # the first updates skipped, each halving the scale
    assert calibration["scale"][8][1] == first / 2**8
    assert collapse["scale"][-1][1] == 1.0  # down to min_scale, where the reporter stopped the run
    assert collapse["scale"][-1][0] < 299  # stopped before its max_steps=300
    assert max(v for _, v in collapse["loss"]) > 10 * collapse["loss"][0][1]  # the loss explodes (20x-100x by stack)
    assert underflow["underflow"][0][1] > 0.5 > underflow["underflow"][-1][1]  # lost until the scale grew
    assert underflow["skipped"] == []
    assert underflow["headroom"][0][1] > 20


def test_every_picture_is_shown_in_the_docs_and_every_shown_one_is_drawn():
    pages = {p: Path(p).read_text() for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)}
    shown = {m for text in pages.values() for m in re.findall(r"figures/(\w+)\.png", text)}
    files = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(FIGURES.FOLDER, "*.png"))}
    assert shown == files == set(FIGURES.FIGURES)


def test_the_keys_the_loggers_page_says_to_chart_are_logged(runs):
    page = Path(DOCS, "guide", "curves.md").read_text()
    named = set(re.findall(r"`(amp/\w+)`", page))
    logged = set().union(*(keys for _, keys in runs.values()))
    assert {"amp/log2_loss_scale", "amp/skipped_steps", "amp/underflow_fraction", "amp/headroom_bits"} <= named
    assert named - logged == {"amp/plugin"}, named - logged  # the plugin's call is a hyperparameter, not a series
