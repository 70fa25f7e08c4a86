"""What went wrong in a mixed-precision run, and the one-line fix: the rules behind ``AmpAdvisor`` and ``advise``.

Standard library only (the ``advise`` command reads logs without torch). :func:`advise` reads a :class:`RunFigures`
(built live by :class:`~lightning_amp_plus.AmpAdvisor` from the plugin and the callbacks, or offline from a logged
run by :func:`figures_from_series`) and returns :class:`Advice` objects, most important first.

The rooms, one per family (each rule's helpers beside it):

- ``registry.py``: :class:`Advice`, :class:`RunFigures`, :class:`Rule`, :func:`rule`, :func:`advise`, the verdict line.
- ``origins.py``: where the inf/nan came from (the loss, the model's own NaN, an island's overflow, own code).
- ``bf16.py``: float16's range at the scale's floor (``bf16``, ``backward_skips``).
- ``scale.py``: the scale's level (``zero_gradients``, ``init_scale``, ``max_scale``).
- ``growth.py``: the scale's motion (``growth_interval``, ``hysteresis``, ``skip_rate``).
- ``speed.py``: the speed hints (``silent_fp32``, ``fused_optimizer``).
- ``figures.py``: readings several families share; ``fix.py``: the fix line; ``offline.py``: reading a log.

The order of importance is decided once, in :data:`CODES`; :data:`RULES` keeps it.
A figure that is missing (``None``) makes its rule stay silent.
"""

import importlib
import warnings
from typing import Any

# the rule families: each declares its rules into RULES when imported (RULES keeps them in CODES' order)
from lightning_amp_plus.advice import bf16, growth, origins, scale, speed  # noqa: E402,F401
from lightning_amp_plus.advice.figures import HIGH_UNDERFLOW, fitting_scale, most
from lightning_amp_plus.advice.fix import plugin_fix
from lightning_amp_plus.advice.growth import (
    GROWTH_UNDERFLOW,
    HIGH_SKIP_RATE,
    MIN_ISOLATED_BACKOFFS,
    MIN_UPDATES_AFTER_BACKOFF,
    SETTLED_SKIP_RATE,
    TRAILING_STREAK,
    trailing_streak,
)
from lightning_amp_plus.advice.offline import PLUGIN_HPARAM, figures_from_series, parse_plugin_call, plugin_call
from lightning_amp_plus.advice.registry import (
    CODES,
    RULES,
    Advice,
    Rule,
    RunFigures,
    advise,
    collapse_advice,
    docs_table,
    findings,
    healthy_line,
    hint_line,
    judged,
    needs_live,
    nothing_applied,
    rule,
)
from lightning_amp_plus.advice.scale import MAX_PROPOSED_SCALE
from lightning_amp_plus.advice.speed import MIN_FUSED_GAIN, MIN_LOWERED_SPEEDUP

_FAMILIES = ("registry", "figures", "fix", "origins", "bf16", "scale", "growth", "speed", "offline")


def __getattr__(name: str) -> Any:
    """0.4's ``advice.py`` held every helper and import in one module: a name found in a family warns and is given."""
    for family in _FAMILIES:
        found = vars(importlib.import_module(f"{__name__}.{family}"))
        if name in found:
            warnings.warn(
                f"`{__name__}.{name}` moved to `{__name__}.{family}.{name}`; the old path goes in 0.6.",
                DeprecationWarning,
                stacklevel=2,
            )
            return found[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CODES",
    "GROWTH_UNDERFLOW",
    "HIGH_SKIP_RATE",
    "HIGH_UNDERFLOW",
    "MAX_PROPOSED_SCALE",
    "MIN_FUSED_GAIN",
    "MIN_ISOLATED_BACKOFFS",
    "MIN_LOWERED_SPEEDUP",
    "MIN_UPDATES_AFTER_BACKOFF",
    "PLUGIN_HPARAM",
    "RULES",
    "SETTLED_SKIP_RATE",
    "TRAILING_STREAK",
    "Advice",
    "Rule",
    "RunFigures",
    "advise",
    "collapse_advice",
    "docs_table",
    "figures_from_series",
    "findings",
    "fitting_scale",
    "healthy_line",
    "hint_line",
    "judged",
    "most",
    "needs_live",
    "nothing_applied",
    "parse_plugin_call",
    "plugin_call",
    "plugin_fix",
    "rule",
    "trailing_streak",
]
