"""Hand-made semantic mutants of the code 0.3 added or changed, each with the tests that must kill it.

mutmut flips operators, which die easily; the bugs a developer makes are a state reset dropped, a knob precedence
turned around, a guard removed. Each entry here is one of those: the file, its exact source, the mutated source, the
bug in one line, and the tests written to catch it. ``python -m tests.helpers.mutants`` clones HEAD into a temporary
folder (your working tree is never touched: commit the tests first), runs every listed test there once unmutated
(they must pass), then applies each mutant in turn, runs its tests (``pytest -x``; a non-zero exit kills it) and
puts the file back. It prints one line per mutant and ``killed N of M``; ``--only NAME ...`` picks mutants.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Mutant(NamedTuple):
    name: str
    path: str
    original: str
    mutated: str
    bug: str
    tests: tuple[str, ...]


SCALER = "lightning_amp_plus/scaler.py"
ENGINE = "lightning_amp_plus/engine.py"
ADVICE_SCALE = "lightning_amp_plus/advice/scale.py"
OFFLINE = "lightning_amp_plus/advice/offline.py"
FUSED = "lightning_amp_plus/callbacks/_fused.py"
REPORTER = "lightning_amp_plus/callbacks/nan_skip_reporter.py"
PLOT = "lightning_amp_plus/plot.py"

T_SCALER = "tests/test_scaler.py::"
T_EXT = "tests/test_extension_points.py::"
T_ADVICE = "tests/test_advice.py::"
T_ADVISOR = "tests/callbacks/test_advisor.py::"
T_REPORTER = "tests/callbacks/test_nan_skip_reporter.py::"
T_OFFLINE = "tests/test_offline.py::"
COLLAPSE = (
    T_REPORTER + "test_a_collapse_is_raised_at_the_same_step_with_checkpoints_and_the_checkpoint_before_it_is_written"
)

MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- the scaler: from_grad_scaler, reset, update
    Mutant(
        "from_grad_scaler_precedence",
        SCALER,
        '**{"min_scale": 0.0, "max_scale": math.inf, "hysteresis": 1, **kwargs},',
        '**{**kwargs, "min_scale": 0.0, "max_scale": math.inf, "hysteresis": 1},',
        "torch's rule defaults override the caller's knobs",
        (T_SCALER + "test_from_grad_scaler_lets_the_callers_knobs_win_over_torchs_rule",),
    ),
    Mutant(
        "from_grad_scaler_init_scale",
        SCALER,
        "init_scale=scaler.get_scale(),",
        "init_scale=scaler._init_scale,",
        "a used GradScaler's constructor scale, not its live one, is the new scaler's init_scale (repr, reset)",
        (
            T_SCALER + "test_a_used_grad_scaler_gives_a_scaler_whose_repr_and_reset_start_at_its_scale",
            T_EXT + "test_the_logged_call_of_a_used_grad_scaler_starts_at_its_scale",
        ),
    ),
    Mutant(
        "from_grad_scaler_state",
        SCALER,
        "        made.load_state_dict(scaler.state_dict())\n",
        "",
        "the GradScaler's growth tracker is not carried over",
        (T_EXT + "test_a_used_grad_scaler_brings_its_scale_and_growth_tracker",),
    ),
    Mutant(
        "from_grad_scaler_disabled",
        SCALER,
        "        if not scaler.is_enabled():\n",
        "        if False:\n",
        "a disabled GradScaler is not refused by name",
        (T_SCALER + "test_from_grad_scaler_refuses_a_disabled_scaler_by_name",),
    ),
    Mutant(
        "reset_last_record",
        SCALER,
        "        self._host = HostMirror()\n        self._last = None\n",
        "        self._host = HostMirror()\n",
        "reset() keeps the last run's update record",
        (T_SCALER + "test_a_reset_forgets_the_last_updates_record",),
    ),
    Mutant(
        "reset_growth_tracker",
        SCALER,
        "        self._set_knobs(self._constructed)\n        self._init_growth_tracker = 0\n",
        "        self._set_knobs(self._constructed)\n",
        "reset() keeps a loaded growth tracker",
        (T_SCALER + "test_a_reset_starts_the_growth_tracker_at_zero_after_a_loaded_one",),
    ),
    Mutant(
        "update_without_inf_check",
        SCALER,
        "        if not states:\n            return None\n",
        "        if not states:\n            return False\n",
        "a cycle with no inf check recorded is read as clean (no torch error, the update counted)",
        (T_SCALER + "test_an_update_whose_cycle_never_stepped_raises_torchs_error_as_gradscaler_does",),
    ),
    Mutant(
        "update_new_scale_unbounded",
        SCALER,
        "            live.clamp_(min=self._floor, max=self._max_scale)\n",
        "",
        "update(new_scale) keeps a caller's scale outside [min_scale, max_scale]",
        (T_SCALER + "test_a_callers_scale_is_kept_inside_the_bounds_and_ends_the_cycle",),
    ),
    # ---------------------------------------------------------------- the engine: update records, take_scaler, scaler=
    Mutant(
        "update_record_reused",
        ENGINE,
        "if outcome is None or outcome is self._last_record:",
        "if outcome is None:",
        "an override that calls super().update() only sometimes has the last record read again",
        (T_EXT + "test_an_update_override_that_calls_super_only_on_some_updates_is_the_same_clear_error",),
    ),
    Mutant(
        "take_scaler_mock_disabled",
        ENGINE,
        "if isinstance(inner, torch.amp.GradScaler) and not inner.is_enabled():",
        "if isinstance(scaler, torch.amp.GradScaler) and not scaler.is_enabled():",
        "the disabled check reads the mock, not the scaler it wraps",
        (T_EXT + "test_a_mock_wrapping_a_disabled_scaler_is_refused_like_the_scaler_itself",),
    ),
    Mutant(
        "take_scaler_process_group",
        ENGINE,
        'extra = {"process_group": scaler.process_group} if sharded and hasattr(scaler, "process_group") else {}',
        "extra: dict = {}",
        "a ShardedGradScaler's process group is dropped (HSDP reduces over the world)",
        (T_EXT + "test_a_sharded_grad_scaler_given_to_the_fsdp_plugin_keeps_its_process_group",),
    ),
    Mutant(
        "take_scaler_unsharded",
        ENGINE,
        "wanted = ShardedDynamicLossScaler if sharded else DynamicLossScaler",
        "wanted = DynamicLossScaler",
        "FSDP takes an unsharded scaler",
        (T_EXT + "test_the_fsdp_plugin_takes_a_sharded_scaler_and_refuses_an_unsharded_one",),
    ),
    Mutant(
        "setter_unchecked",
        ENGINE,
        "engine.use_scaler(take_scaler(type(self).__name__, value, engine.precision, engine.sharded))",
        "engine.use_scaler(\n            value if isinstance(value, DynamicLossScaler)"
        " else take_scaler(type(self).__name__, value, engine.precision, engine.sharded)\n        )",
        "plugin.scaler = <our scaler> skips the checks the constructor makes",
        (
            T_EXT + "test_setting_an_unsharded_scaler_on_the_fsdp_plugin_is_refused_as_the_constructor_does",
            T_EXT + "test_setting_the_scaler_checks_it_as_the_argument_does",
        ),
    ),
    Mutant(
        "use_scaler_state",
        ENGINE,
        "self._given_state = scaler.state_dict()",
        "self._given_state = None",
        "a new fit starts the given scaler from its constructor's state, not as given",
        (T_EXT + "test_a_loaded_scaler_given_as_it_is_starts_each_new_fit_from_its_state",),
    ),
    Mutant(
        "use_scaler_checker",
        ENGINE,
        "self.scaler = self.checker = scaler",
        "self.scaler = scaler",
        "the old scaler still decides the skips",
        (T_EXT + "test_setting_the_scaler_checks_it_as_the_argument_does",),
    ),
    Mutant(
        "setter_keeps_old_knobs",
        ENGINE,
        'given = {k: v for k, v in getattr(self, "_given", {}).items() if k not in SCALER_DEFAULTS}',
        'given = dict(getattr(self, "_given", {}))',
        "the logged call keeps the knobs of the scaler replaced",
        (T_EXT + "test_the_logged_call_names_the_given_scalers_knobs",),
    ),
    Mutant(
        "fsdp_not_sharded",
        "lightning_amp_plus/fsdp.py",
        "    _sharded = True\n",
        "    _sharded = False\n",
        "the FSDP plugin's scaler does not reduce over ranks",
        (T_EXT + "test_the_fsdp_plugin_takes_a_sharded_scaler_and_refuses_an_unsharded_one",),
    ),
    Mutant(
        "plugin_prints_given_scaler",
        "lightning_amp_plus/precision.py",
        'self._given["scaler"] = self._engine.scaler',
        'self._given["scaler"] = scaler',
        "the plugin's repr shows the GradScaler given, not the scaler in use",
        (T_EXT + "test_a_given_grad_scaler_prints_as_the_scaler_in_use",),
    ),
    # ---------------------------------------------------------------- advice: a scale too low, pinned, settled
    Mutant(
        "pinned_noop_fix",
        ADVICE_SCALE,
        "    if new <= max_scale:\n",
        "    if new < max_scale:\n",
        "a scale pinned at 2**64 gets the no-op fix max_scale=2**64",
        (T_ADVICE + "test_a_scale_pinned_at_or_beyond_the_highest_proposed_scale_gets_no_noop_fix",),
    ),
    Mutant(
        "pinned_uncapped",
        ADVICE_SCALE,
        "max(MAX_PROPOSED_SCALE, max_scale), _overflowed(figures) / 2)",
        "_overflowed(figures) / 2)",
        "a pinned scale's fix is not capped at 2**64",
        (T_ADVICE + "test_a_scale_pinned_at_or_beyond_the_highest_proposed_scale_gets_no_noop_fix",),
    ),
    Mutant(
        "pinned_above_overflow",
        ADVICE_SCALE,
        "max(MAX_PROPOSED_SCALE, max_scale), _overflowed(figures) / 2)",
        "max(MAX_PROPOSED_SCALE, max_scale))",
        "a pinned scale is raised above where the run's backward overflowed",
        (T_ADVICE + "test_a_pinned_scale_is_not_raised_where_the_runs_backward_overflowed",),
    ),
    Mutant(
        "settled_past_growth",
        ADVICE_SCALE,
        "            if value > lowest:\n                break\n",
        "            if value > lowest:\n                continue\n",
        "the settled scale takes a backoff after the scale grew back",
        (T_ADVICE + "test_the_settled_scale_is_the_first_one_even_when_a_later_backoff_goes_lower",),
    ),
    Mutant(
        "settled_any_backoff",
        ADVICE_SCALE,
        "            if at - 1 in scaling:",
        "            if True:",
        "the settled scale counts a NaN batch's backoff",
        (T_ADVICE + "test_the_settled_scale_leaves_out_a_backoff_from_a_nan_batch",),
    ),
    Mutant(
        "too_low_uncapped",
        ADVICE_SCALE,
        'new = min(min(m["scale"] * 2.0 ** math.floor(m["headroom_bits"] - 1) for m in low), MAX_PROPOSED_SCALE)',
        'new = min(m["scale"] * 2.0 ** math.floor(m["headroom_bits"] - 1) for m in low)',
        "a scale too low is raised past 2**64",
        (T_ADVICE + "test_a_scale_too_low_is_raised_at_most_to_the_highest_proposed_scale",),
    ),
    Mutant(
        "too_low_above_overflow",
        ADVICE_SCALE,
        "    new = min(new, overflowed / 2)\n",
        "",
        "a scale too low is raised to where the run's backward overflowed",
        (T_ADVICE + "test_a_scale_too_low_is_never_raised_to_where_the_runs_backward_overflowed",),
    ),
    Mutant(
        "too_low_unknown_cap",
        ADVICE_SCALE,
        "capped = figures.knobs is None or new > _cap(figures)",
        "capped = new > _cap(figures)",
        "an unknown cap (offline, resumed) is taken as the default one",
        (T_ADVICE + "test_a_scale_too_low_whose_cap_is_not_known_raises_the_cap_with_it",),
    ),
    Mutant(
        "too_low_at_cap",
        ADVICE_SCALE,
        "        and not _at_max(figures, m)\n",
        "",
        "a scale at its cap is told too low (max_scale's case)",
        (T_ADVICE + "test_a_scale_too_low_gets_the_scale_its_headroom_allows_never_healthy",),
    ),
    # ---------------------------------------------------------------- the fused call reader
    Mutant(
        "fused_positional_self",
        FUSED,
        'order = [n for n in signature if n != "self"]',
        "order = list(signature)",
        "positional settings are read one place off (`self` counted)",
        (T_ADVISOR + "test_the_fused_fix_reads_settings_passed_by_position",),
    ),
    Mutant(
        "fused_positional_ignored",
        FUSED,
        "written = {**dict(zip(order, call.args, strict=False)), **{k.arg: k.value for k in call.keywords if k.arg}}",
        "written = {k.arg: k.value for k in call.keywords if k.arg}",
        "settings passed by position are not read",
        (T_ADVISOR + "test_the_fused_fix_reads_settings_passed_by_position",),
    ),
    Mutant(
        "fused_first_of_two",
        FUSED,
        "if len(calls) != 1 or any(",
        "if not calls or any(",
        "of two calls that could have built it, the first is copied",
        (T_ADVISOR + "test_the_fused_fix_copies_neither_of_two_calls_that_could_have_built_the_optimizer",),
    ),
    Mutant(
        "fused_params_unchecked",
        FUSED,
        "        if params is not None and not (call.args and text(call.args[0]) == params):\n",
        "        if False:\n",
        "a call on other parameters is taken as the optimizer's",
        (T_ADVISOR + "test_the_fused_fix_is_the_users_own_call_or_its_values",),
    ),
    Mutant(
        "fused_keeps_fused_false",
        FUSED,
        'parts += [f"{k.arg}={text(k.value)}" for k in call.keywords if k.arg not in _MADE_WAY]',
        'parts += [f"{k.arg}={text(k.value)}" for k in call.keywords]',
        "the copied call keeps fused=False/foreach= beside fused=True",
        (T_ADVISOR + "test_the_fused_fix_copies_only_a_call_that_built_the_optimizer_and_stays_valid_python",),
    ),
    # ---------------------------------------------------------------- the reporter's checkpointing
    Mutant(
        "collapse_unchecked_at_log",
        REPORTER,
        "            self._check_unchecked()  # skips a checkpoint",
        "            pass  # skips a checkpoint",
        "skips a checkpoint collected are checked for a collapse only at the end of fit (the 0.3 bug)",
        (COLLAPSE,),
    ),
    Mutant(
        "collapse_in_checkpoint",
        REPORTER,
        "            self.collect(check=False)",
        "            self.collect()",
        "the checkpoint's collection raises the collapse itself: the checkpoint is not written",
        (COLLAPSE,),
    ),
    Mutant(
        "collapse_unchecked_dropped",
        REPORTER,
        "        else:\n            self._unchecked.append((record, consecutive))\n",
        "",
        "skips collected without the check are never checked",
        (COLLAPSE,),
    ),
    Mutant(
        "collapse_unchecked_at_finish",
        REPORTER,
        "        self._collect_device_skips(updated=True)\n        self._check_unchecked()\n",
        "        self._collect_device_skips(updated=True)\n",
        "skips AmpAdvisor collected at the end of fit are never checked",
        (T_REPORTER + "test_the_collapse_is_raised_whoever_collects_the_last_skips",),
    ),
    # ---------------------------------------------------------------- the offline readers
    Mutant(
        "hparams_tagged_mapping",
        PLOT,
        "        if isinstance(node, yaml.MappingNode):\n            return loader.construct_mapping(node)\n",
        "",
        "a python-tagged mapping (argparse.Namespace) makes hparams.yaml unreadable",
        (T_OFFLINE + "test_an_hparams_file_with_a_python_tagged_mapping_is_read",),
    ),
    Mutant(
        "advise_bf16_refused",
        "lightning_amp_plus/__main__.py",
        "if not figures.curve and figures.skipped is None:",
        "if not figures.curve:",
        "advise refuses a bf16 run's log (skips, no scale) as having no amp/ series",
        (T_OFFLINE + "test_advise_on_a_bf16_runs_log_reads_its_skips_without_a_scale",),
    ),
    Mutant(
        "holds_opens_a_folder",
        PLOT,
        'if series or path is None or not path.endswith(".csv") or not os.path.isfile(path):',
        "if series or path is None:",
        "advise on a TensorBoard folder without scalars opens the folder as a CSV: a traceback",
        (T_OFFLINE + "test_advise_on_a_tensorboard_folder_without_scalars_is_one_error_line",),
    ),
    Mutant(
        "offline_knobs_of_a_resumed_run",
        OFFLINE,
        "            and figures.curve[0][0] == 0\n",
        "",
        "a resumed run's logged call is taken for its knobs (its checkpoint's replace them)",
        (T_ADVICE + "test_offline_the_knobs_are_the_logged_calls_only_for_a_fit_logged_from_step_0",),
    ),
]


def _pytest(folder: str, tests: list[str]) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", *tests]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, check=False).returncode


def check(mutants: list[Mutant], folder: str) -> list[tuple[Mutant, bool]]:
    """Each mutant applied in ``folder`` (a clone), its tests run, the file put back: (mutant, killed)."""
    results = []
    for mutant in mutants:
        path = os.path.join(folder, mutant.path)
        with open(path) as f:
            source = f.read()
        found = source.count(mutant.original)
        if found != 1:
            raise SystemExit(f"{mutant.name}: its original occurs {found} times in {mutant.path}, expected once")
        with open(path, "w") as f:
            f.write(source.replace(mutant.original, mutant.mutated))
        try:
            killed = _pytest(folder, list(mutant.tests)) != 0
        finally:
            with open(path, "w") as f:
                f.write(source)
        results.append((mutant, killed))
        print(f"{'killed' if killed else 'SURVIVED':8s} {mutant.name:32s} {mutant.path}: {mutant.bug}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.mutants", description=__doc__)
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    unknown = sorted(set(args.only or []) - {m.name for m in MUTANTS})
    if unknown:
        raise SystemExit(f"unknown mutants: {unknown}")
    if args.list:
        for mutant in chosen:
            print(f"{mutant.name:32s} {mutant.path}: {mutant.bug}")
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutants-") as folder:
        subprocess.run(["git", "clone", "-q", ROOT, folder], check=True)
        tests = sorted({t for m in chosen for t in m.tests})
        if _pytest(folder, tests) != 0:
            raise SystemExit(f"the mutants' tests fail on HEAD unmutated in {folder}: fix them first")
        results = check(chosen, folder)
    killed = sum(1 for _, k in results if k)
    print(f"killed {killed} of {len(results)} ({time.monotonic() - start:.0f} s)")
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
