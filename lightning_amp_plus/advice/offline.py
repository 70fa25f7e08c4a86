"""Reading a logged run offline (``python -m lightning_amp_plus advise``): the figures a log supports.

Also the plugin's logged call (``LossScaleMonitor`` logs it; a fix line repeats it).
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from lightning_amp_plus import knobs
from lightning_amp_plus._series import logged_updates, prefix_of, scale_changes, scale_key, skipped_steps, value_at
from lightning_amp_plus.advice.fix import plugin_fix
from lightning_amp_plus.advice.registry import RunFigures

#: the hyperparameter (after the monitor's prefix) under which ``LossScaleMonitor`` logs the plugin's call
PLUGIN_HPARAM = "plugin"


#: the plugin classes whose logged call a fix line repeats, and their positional arguments
_PLUGINS = ("AmpPlusPrecision", "AmpPlusFSDPPrecision", "AmpPlusFabricPrecision")


_POSITIONAL = ("precision", "device")


def figures_from_series(
    series: dict[str, list[tuple[int, float]]], hparams: Optional[dict[str, Any]] = None
) -> RunFigures:
    """The figures a logged run supports (the ``advise`` command): scale curve, skips, underflow, headroom.

    ``hparams`` are the run's logged hyperparameters: the plugin's call ``LossScaleMonitor`` logged there (as
    ``amp/plugin``) makes every fix the run's own call with one change, as the live advisor's.
    """
    key = scale_key(series)
    skip_key = next((k for k in series if k.endswith("skipped_steps") or k.endswith("step_skipped")), None)
    prefix = ""
    figures = RunFigures()
    if key is not None:
        prefix = prefix_of(key)
        figures.precision = "16-mixed"
        figures.curve = scale_changes(series, key)
    elif skip_key is not None:
        prefix = skip_key[: skip_key.rindex("/") + 1] if "/" in skip_key else ""
        figures.precision = "bf16-mixed"
    call = parse_plugin_call((hparams or {}).get(prefix + PLUGIN_HPARAM))
    if call is not None:
        figures.plugin, figures.plugin_args = call
        if (
            figures.precision == "16-mixed"
            and "scaler" not in figures.plugin_args
            and bool(figures.curve)
            and figures.curve[0][0] == 0
        ):  # a fit from step 0: a resumed one's knobs may be its checkpoint's, which replace the call's
            given = knobs.knob_values({k: v for k, v in figures.plugin_args.items() if k in knobs.NAMES})
            # the run's own call: its knobs, the defaults where it left them out; the scale where the log starts
            figures.knobs = {**knobs.DEFAULTS, **given, "init_scale": figures.curve[0][1]}
    figures.skipped = skipped_steps(series, prefix)
    figures.reporter_logged = bool(series.get(prefix + "step_skipped"))
    figures.advisor_logged = bool(series.get("amp/advice"))  # the advisor logs under amp/, whatever the monitor's
    told = series.get(prefix + "skip_loss_nonfinite")
    if told:
        figures.loss_nonfinite = sorted(step for step, value in told if value > 0)
    underflow = dict(series.get(prefix + "underflow_fraction", []))
    headroom = dict(series.get(prefix + "headroom_bits", []))
    if underflow and figures.curve:
        figures.underflow = [
            {
                "step": step,
                "scale": value_at(figures.curve, step),
                "underflow_fraction": value,
                "headroom_bits": headroom.get(step),
            }
            for step, value in sorted(underflow.items())
        ]
    steps = {s for values in series.values() for s, _ in values}
    if steps:
        figures.last_step = max(steps)
        figures.num_updates = logged_updates(series, prefix, figures.skipped, min(steps), figures.last_step)
    return figures


def plugin_call(plugin: str, args: dict[str, Any]) -> str:
    """The call that built a plugin, as ``LossScaleMonitor`` logs it: :func:`plugin_fix` with no change.

    Example:
        >>> plugin_call("AmpPlusPrecision", {"init_scale": 2.0**20, "fp32_modules": ["head"]})
        'AmpPlusPrecision("16-mixed", init_scale=2.0**20, fp32_modules=["head"])'
    """
    return plugin_fix(RunFigures(plugin=plugin, plugin_args=dict(args)))


def parse_plugin_call(text: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """The plugin class name and arguments of a logged :func:`plugin_call`; None for anything else.

    Only literals are read (numbers, ``2.0**k``, strings, lists, ``None``): nothing is evaluated.

    Example:
        >>> parse_plugin_call('AmpPlusPrecision("16-mixed", init_scale=2.0**20, growth_interval=100)')
        ('AmpPlusPrecision', {'precision': '16-mixed', 'init_scale': 1048576.0, 'growth_interval': 100})
        >>> parse_plugin_call("os.system('x')") is None
        True
    """
    if not isinstance(text, str):
        return None
    try:
        call = ast.parse(text.strip(), mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in _PLUGINS):
            return None
        if len(call.args) > len(_POSITIONAL) or any(k.arg is None for k in call.keywords):
            return None
        args = {name: _literal_value(node) for name, node in zip(_POSITIONAL, call.args, strict=False)}
        args.update({str(k.arg): _literal_value(k.value) for k in call.keywords})
    except (SyntaxError, ValueError, TypeError, OverflowError, RecursionError):
        return None
    return call.func.id, args


def _literal_value(node: ast.AST) -> Any:
    """What :func:`_literal` wrote, read back: constants, ``-x``, ``2.0**k``, lists and tuples of those."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        values = [_literal_value(e) for e in node.elts]
        return values if isinstance(node, ast.List) else tuple(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_number(_literal_value(node.operand))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "float"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in ("inf", "-inf", "nan")
    ):
        return float(node.args[0].value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _number(_literal_value(node.left)), _number(_literal_value(node.right))
        if abs(exponent) > 1100:
            raise ValueError("exponent out of range")
        return base**exponent
    raise ValueError(f"not a literal: {ast.dump(node)}")


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    return value
