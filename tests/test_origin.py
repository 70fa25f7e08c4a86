"""The typed origin: one value written by the finder and the reruns, read by the rules and the skip lines."""

import pytest

from lightning_amp_plus.origin import OWN_CODE, Origin, Phase, Verdict, unknown

#: every JSON shape 0.3 writes (a skip record's ``origin``), as the readings' tests pin them
SHAPES = [
    {"phase": "input"},
    {"phase": "loss"},
    {"phase": "loss", "batch": "nonfinite"},
    {"phase": "backward"},
    {"phase": "unknown", "reason": "the replay of net raised RuntimeError: x"},
    {"phase": "forward", "module": "attend", "kind": "nan", "float32": "nonfinite"},
    {"phase": "forward", "module": "energy.0", "kind": "inf", "float32": "finite", "islands": ["energy.0", "head"]},
    {"phase": "forward", "module": "energy.0", "kind": "inf", "float32": "finite", "islands": None},
    {"phase": "forward", "module": "", "kind": "inf", "batch": "nonfinite"},
    {"phase": "forward", "module": "", "kind": "inf", "float32": "finite", "bf16": "nonfinite", "islands": ["embed"]},
    {"phase": "forward", "module": None, "within": "net", "kind": "inf", "reason": "nondeterministic: ..."},
    {"phase": "backward", "module": "", "op": "SqrtBackward0", "kind": "inf", "float32": "nonfinite"},
    {"phase": "backward", "reason": "the rerun's backward was finite: it did not make them again"},
    {"phase": "input", "rank": 1, "step": 7},
]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_json_shape_reads_and_writes_back_as_it_was(shape):
    assert Origin.from_dict(shape).to_dict() == shape


def test_the_own_code_is_a_value_and_the_verdicts_enums():
    own = Origin.from_dict({"phase": "forward", "module": "", "kind": "inf", "float32": "finite"})
    assert own.module is OWN_CODE
    assert own.own_code
    assert own.name == ""
    assert own.where == "the LightningModule's own code"
    assert own.float32 is Verdict.FINITE
    assert not own.overflow  # an overflow names a module: the own code is no island
    named = Origin(Phase.FORWARD, "head", "inf", Verdict.FINITE)
    assert named.overflow
    assert not named.own_code


def test_islands_not_measured_and_none_found_are_told_apart():
    assert Origin(Phase.FORWARD, "head", "inf", Verdict.FINITE).to_dict().get("islands", "absent") == "absent"
    assert Origin(Phase.FORWARD, "head", "inf", Verdict.FINITE, islands=()).to_dict()["islands"] is None
    assert unknown("why").to_dict() == {"phase": "unknown", "reason": "why"}


def test_an_unknown_phase_is_refused_by_name():
    with pytest.raises(ValueError, match="unheard-of"):
        Origin.from_dict({"phase": "unheard-of"})
