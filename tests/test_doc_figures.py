"""The documentation's pictures are drawn from their seeded runs, as those runs go now.

``docs/_figures.py`` runs each picture's seeded CPU fit and draws its logged curves with the package's plot; each
PNG carries the curves it was drawn from. Here each run is made again and compared with what its picture carries:
the series, not the pixels. A seeded run's float16 arithmetic is the stack's: on another torch or Lightning than the
one the pictures were made on, or a CPU with other vector kernels (AVX2 and AVX512 round float16 apart: a loss 3% off
after six steps), the comparison is skipped (the pictures still have to be there and shown).
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


def _carried(name):
    with Image.open(os.path.join(FIGURES.FOLDER, f"{name}.png")) as image:
        return json.loads(image.text[FIGURES.CURVES_KEY]), image.text[FIGURES.STACK_KEY]


def _same(drawn, now, path="curves"):
    """Equal, floats to 1e-9 relative (a value written to CSV and read back), steps and lengths exactly."""
    if isinstance(drawn, float) and isinstance(now, float):
        assert math.isclose(drawn, now, rel_tol=1e-9, abs_tol=1e-12), (path, drawn, now)
    elif isinstance(drawn, dict):
        assert drawn.keys() == now.keys(), path
        for key in drawn:
            _same(drawn[key], now[key], f"{path}.{key}")
    elif isinstance(drawn, list):
        assert len(drawn) == len(now), (path, len(drawn), len(now))
        for i, (a, b) in enumerate(zip(drawn, now, strict=True)):
            _same(a, b, f"{path}[{i}]")
    else:
        assert drawn == now, (path, drawn, now)


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
    drawn, made_on = _carried(name)
    if made_on != FIGURES.stack():
        pytest.skip(f"the pictures were made on {made_on}, this is {FIGURES.stack()}")
    now, _ = runs[name]
    try:
        _same(drawn, now)
    except AssertionError as error:
        raise AssertionError(
            f"docs/figures/{name}.png: {error}; redraw it with `python docs/_figures.py {name}`"
        ) from None


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
