"""Mutation testing by module group: ``python -m tests.helpers.mutation run GROUP`` and ``... stats DIR``.

The whole package against the whole fast suite is about 6,600 mutants and more than four hours on 2 cores (a
surviving mutant of a function every Trainer test reaches costs all of those tests). A group mutates a few modules
against the test files written for them, in a fresh clone of HEAD (so edits in your tree cannot race the run),
and prints killed of checked per module. A narrower selection can only kill fewer mutants: its figures are a lower
bound of what the whole suite kills.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: group -> (module patterns, test selection); every selection also runs the package's doctests
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "tools": (
        ["plot", "__main__", "_series", "forensics._tree", "_identity", "islands", "syncs", "fabric", "fsdp"],
        [
            "tests/test_plot.py",
            "tests/test_islands.py",
            "tests/test_tree.py",
            "tests/test_identity.py",
            "tests/test_fabric.py",
            "tests/test_fsdp.py",
            "tests/test_syncs.py",
            "tests/test_history.py",
            "tests/callbacks/test_advisor.py::test_the_advise_command_gives_what_the_logged_series_support",
            "tests/callbacks/test_advisor.py::test_the_advise_command_without_amp_series_is_one_error_line",
            "tests/callbacks/test_advisor.py::test_the_advise_command_counts_its_findings_and_reads_a_curve_without_skips",
        ],
    ),
    "core": (
        ["scaler", "knobs", "history", "advice", "_validation", "_repr", "_scope", "_log", "_limits"],
        [
            "tests/test_scaler.py",
            "tests/test_extension_points.py",  # the scaler's extension points, through the plugins
            "tests/test_cycle_rules.py",
            "tests/test_history.py",
            "tests/test_advice.py",
            "tests/test_bad_input.py",
            "tests/test_properties.py",
        ],
    ),
    "engine": (
        ["engine", "precision"],
        [
            "tests/test_cycle_rules.py",
            "tests/test_update_cycle.py",
            "tests/test_precision.py",
            "tests/test_faults.py",
            "tests/test_checkpoints.py",
            "tests/test_exactness.py",
            "tests/test_bad_input.py",
            "tests/test_docs.py",  # the documented defaults (docs/guide)
            "tests/test_fsdp.py",  # which plugin reduces over ranks (FakePeer; the 2-process tests are slow)
            # the scheduler rule's outcome tests live with the reporter
            "tests/callbacks/test_nan_skip_reporter.py::test_warmup_is_not_consumed_by_skipped_steps",
            "tests/callbacks/test_nan_skip_reporter.py::test_stock_lightning_steps_the_scheduler_on_skipped_steps",
            "tests/callbacks/test_nan_skip_reporter.py::test_scheduler_skipping_can_be_turned_off",
        ],
    ),
    "callbacks": (
        ["callbacks", "forensics"],
        # the callbacks' messages are pinned in test_bad_input, what the monitor logs in bf16 in test_plot
        [
            "tests/callbacks/",
            "tests/test_origins.py",
            "tests/test_side_effects.py",
            "tests/test_first_hour.py",
            "tests/test_backward_origins.py",
            "tests/test_readings.py",
            "tests/test_watch_never_touches.py",
            "tests/test_replays_on_real_code.py",
            "tests/test_tree.py",
            "tests/test_compile.py",
            "tests/test_bad_input.py",
            "tests/test_plot.py",
            "tests/test_docs.py",  # each callback's defaults, read from what was built
        ],
    ),
}


def run(group: str, workers: int, folder: str | None, only: list[str] | None = None) -> str:
    modules, selection = GROUPS[group]
    if only:
        unknown = sorted(m for m in only if not any(m == g or m.startswith(g + ".") for g in modules))
        if unknown:
            raise SystemExit(f"--only: {unknown} not in group {group!r}; its modules are {modules}")
        modules = only
    folder = folder or tempfile.mkdtemp(prefix=f"mutation-{group}-")
    subprocess.run(["git", "clone", "-q", ROOT, folder], check=True)
    path = os.path.join(folder, "pyproject.toml")
    with open(path) as f:
        text = f.read()
    line = 'pytest_add_cli_args_test_selection = ["tests/"]'
    if line not in text:
        raise SystemExit(f"{path}: expected the line {line!r} to narrow")
    chosen = ", ".join(json.dumps(s) for s in [*selection, "lightning_amp_plus/"])
    with open(path, "w") as f:
        f.write(text.replace(line, f"pytest_add_cli_args_test_selection = [{chosen}]"))
    patterns = [f"lightning_amp_plus.{m}*" for m in modules]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(workers), *patterns]
    subprocess.run(cmd, cwd=folder, env=env, check=False)
    return folder


def _metas(folder: str) -> dict[str, dict[str, Any]]:
    root = os.path.join(folder, "mutants")
    found = {}
    for meta in sorted(glob.glob(os.path.join(root, "lightning_amp_plus", "**", "*.meta"), recursive=True)):
        with open(meta) as f:
            found[meta] = json.load(f)
    return found


def recheck(
    folder: str, workers: int, selection: list[str], only: list[str] | None = None, tests_of_head: bool = False
) -> list[str]:
    """Run a group run's survivors again against a wider selection (default: every fast test); keep the rest.

    A mutant the group's tests killed is killed by any wider selection too, so after this the figures of the checked
    mutants are those of the wider selection. mutmut forgets every result when its selection changes: the results
    are saved first and merged back, each survivor taking its new outcome.
    """
    before = _metas(folder)
    survivors = [
        name
        for data in before.values()
        for name, code in data["exit_code_by_key"].items()
        if code in (0, 33) and (not only or any(f".{m}." in name for m in only))
    ]
    if not survivors:
        return []
    if tests_of_head:
        take_tests_of_head(folder)
    path = os.path.join(folder, "pyproject.toml")
    with open(path) as f:
        text = f.read()
    start = text.index("pytest_add_cli_args_test_selection = [")
    end = text.index("]", start) + 1
    chosen = ", ".join(json.dumps(s) for s in [*selection, "lightning_amp_plus/"])
    with open(path, "w") as f:
        f.write(text[:start] + f"pytest_add_cli_args_test_selection = [{chosen}]" + text[end:])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(workers), *survivors]
    subprocess.run(cmd, cwd=folder, env=env, check=False)
    after = _metas(folder)
    for meta, data in before.items():
        fresh = after.get(meta, {}).get("exit_code_by_key", {})
        for name in data["exit_code_by_key"]:
            if name in survivors and fresh.get(name) is not None:
                data["exit_code_by_key"][name] = fresh[name]
        with open(meta, "w") as f:
            json.dump(data, f)
    return survivors


def take_tests_of_head(folder: str) -> None:
    """Put HEAD's ``tests/`` in a run's folder if the package there is HEAD's: mutmut needs the whole selection green
    on the run's source, and a test written for a later change fails on an earlier package."""
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, check=True)
    changed = subprocess.run(
        ["git", "diff", "--name-only", here.stdout.strip(), "HEAD", "--", "lightning_amp_plus/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if changed:
        raise SystemExit(f"the package changed since the run ({', '.join(changed)}): run the group again instead")
    archive = subprocess.run(["git", "archive", "HEAD", "tests"], cwd=ROOT, capture_output=True, check=True).stdout
    for target in (folder, os.path.join(folder, "mutants")):
        subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)


def stats(folder: str) -> list[dict[str, Any]]:
    """Per module: mutants, checked, killed, survived (no tests counts as survived), from mutmut's ``.meta`` files."""
    rows = []
    root = os.path.join(folder, "mutants")
    for meta in sorted(glob.glob(os.path.join(root, "lightning_amp_plus", "**", "*.meta"), recursive=True)):
        with open(meta) as f:
            codes = json.load(f)["exit_code_by_key"]
        checked = [c for c in codes.values() if c is not None]
        if not checked:
            continue
        survived = sum(1 for c in checked if c in (0, 33))  # 0: survived, 33: no test reached it
        rows.append(
            {
                "module": os.path.relpath(meta, root)[: -len(".meta")],
                "mutants": len(codes),
                "checked": len(checked),
                "killed": len(checked) - survived,
                "survived": survived,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.mutation", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="mutate a group's modules against its tests in a fresh clone of HEAD")
    go.add_argument("group", choices=sorted(GROUPS))
    go.add_argument("--workers", type=int, default=2)
    go.add_argument("--folder", default=None, help="where to clone (default: a new temporary folder)")
    go.add_argument(
        "--only", nargs="+", default=None, metavar="MODULE", help="mutate only these modules (e.g. callbacks.advisor)"
    )
    again = sub.add_parser("recheck", help="a run's survivors against a wider selection (default: every fast test)")
    again.add_argument("folder")
    again.add_argument("--tests", nargs="+", default=["tests/"], help="the wider selection")
    again.add_argument("--workers", type=int, default=2)
    again.add_argument("--only", nargs="+", default=None, metavar="MODULE", help="only these modules' survivors")
    again.add_argument(
        "--tests-of-head",
        action="store_true",
        help="use HEAD's tests (written since the run); refused if the package changed since the run",
    )
    show = sub.add_parser("stats", help="killed of checked per module of a run's folder")
    show.add_argument("folder")
    args = parser.parse_args(argv)
    folder = run(args.group, args.workers, args.folder, args.only) if args.command == "run" else args.folder
    if args.command == "recheck":
        survivors = recheck(folder, args.workers, args.tests, args.only, args.tests_of_head)
        print(f"{len(survivors)} survivors run again")
    for row in stats(folder):
        share = 100 * row["killed"] / row["checked"]
        counts = f"{row['killed']:5d} / {row['checked']:5d} checked of {row['mutants']:5d}"
        print(f"{row['module']:48s} {counts}  {share:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
