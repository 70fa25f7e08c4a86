"""The README's knobs are the code's: every documented argument exists, with the default the README gives."""

import ast
import inspect
import os
import re

import pytest

import lightning_amp_plus

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _readme():
    with open(README) as f:
        return f.read()


HEADINGS = re.findall(r"^### `(\w+)\((.*)\)`$", _readme(), re.MULTILINE)


def _arguments(cls):
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD}


def test_every_public_class_with_arguments_has_its_heading():
    named = {name for name, _ in HEADINGS}
    assert {"AmpPlusPrecision", "LossScaleMonitor", "NaNSkipReporter", "PrecisionReport"} <= named
    assert {"GradUnderflowMonitor", "AmpAdvisor"} <= named


@pytest.mark.parametrize(("name", "signature"), HEADINGS, ids=[name for name, _ in HEADINGS])
def test_each_heading_gives_the_arguments_and_defaults_of_the_code(name, signature):
    shown = signature.replace(", *, ...", "")  # the plugin's keyword-only knobs are in its table
    call = ast.parse(f"f({shown})", mode="eval").body
    documented = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    actual = _arguments(getattr(lightning_amp_plus, name))
    if shown == signature:
        assert documented == actual  # every argument, each with its default
    else:
        assert documented == {k: actual[k] for k in documented}


def test_the_plugins_table_gives_every_knob_and_its_default_in_force():
    text = _readme()
    start = text.index("### `AmpPlusPrecision(")
    table = text[start : text.index("\n###", start + 1)]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.MULTILINE))
    plugin = lightning_amp_plus.AmpPlusPrecision()
    in_force = plugin.scaler.knobs()  # the scaler's knobs are None in the signature: "the default"
    in_force.update(  # read from what was built, not only from the signature
        precision=plugin.precision,
        device=plugin.device,
        skip_nonfinite=plugin.skip_nonfinite,
        skip_scheduler_on_overflow=plugin.skip_scheduler_on_overflow,
        warn_skip_streak=plugin.engine.warn_skip_streak,
    )
    arguments = _arguments(lightning_amp_plus.AmpPlusPrecision)
    assert set(rows) == set(arguments)
    for knob, default in rows.items():
        value = eval(default, {"__builtins__": {}})  # literals and powers such as 2.0**16
        assert (in_force[knob] if knob in in_force else arguments[knob]) == value, knob


CALLBACKS = [(name, signature) for name, signature in HEADINGS if name != "AmpPlusPrecision"]


@pytest.mark.parametrize(("name", "signature"), CALLBACKS, ids=[name for name, _ in CALLBACKS])
def test_each_callback_built_without_arguments_holds_the_defaults_its_heading_gives(name, signature):
    """Read from what was built: a signature can show a default that the constructor does not use."""
    call = ast.parse(f"f({signature})", mode="eval").body
    documented = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    built = getattr(lightning_amp_plus, name)()
    assert {knob: getattr(built, knob) for knob in documented} == documented
