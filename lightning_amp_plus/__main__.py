"""The command line: ``lightning-amp-plus`` (or ``python -m lightning_amp_plus``).

Commands import what they need when they run: ``--help`` and ``--version`` import neither torch nor Lightning.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Optional

from lightning_amp_plus.__about__ import __version__

DESCRIPTION = "lightning-amp-plus: visible, controllable and safe mixed precision for PyTorch Lightning."
#: what PATH may be (the plot, the advice and their errors say the same)
PATHS = "a CSVLogger version folder, a metrics.csv, a ScaleHistory.to_csv() file, or a TensorBoard log folder"
EPILOG = f"""\
PATH is {PATHS}.
Runs are never merged: a folder holding several (lightning_logs/ with version_0 and version_1) is refused with
their list, to pick one from.

examples:
  lightning-amp-plus plot lightning_logs/version_0 -o loss_scale.png
  lightning-amp-plus advise lightning_logs/version_0
  python -m lightning_amp_plus --version
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="lightning-amp-plus",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lightning-amp-plus {__version__}")
    # each command listed once, by argparse, from its help
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    plot = sub.add_parser(
        "plot", help="draw the loss-scale curve and the skipped updates of the run at PATH to a PNG (-o OUT.png)"
    )
    plot.add_argument("path", help=PATHS)
    plot.add_argument(
        "-o", "--output", help="the PNG to write, in a folder that exists (default: loss_scale.png beside PATH)"
    )
    advise = sub.add_parser(
        "advise", help="what the series logged at PATH say went wrong, and the fix (AmpAdvisor's offline half)"
    )
    advise.add_argument("path", help=PATHS)
    args = parser.parse_args(argv)
    if args.command == "advise":
        return _advise(args.path)
    if args.command == "plot":
        from lightning_amp_plus.plot import naming, plot_run, the_run

        try:
            with naming(args.path):
                run = the_run(args.path)
            out = plot_run(args.path, args.output)
        except (ImportError, OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if not _same_path(args.path, run):
            print(_printable(f"the one run at {args.path}: {run}"))
        print(_printable(out))
    return 0


def _advise(path: str) -> int:
    from lightning_amp_plus.advice import advise, figures_from_series, findings, healthy_line, hint_line, needs_live
    from lightning_amp_plus.plot import holds, naming, read_logged

    try:
        with naming(path):
            run = read_logged(path)
        with naming(run.path):  # what its series hold is the run's file's
            figures = figures_from_series(run.series, run.hparams)
    except (ImportError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not figures.curve and figures.skipped is None:
        why = f"no amp/ series found ({holds(run.path, run.series)}); log them with `LossScaleMonitor`"
        print(f"error: {run.path}: {why}.", file=sys.stderr)
        return 2
    if not _same_path(path, run.path):
        print(_printable(f"the one run at {path}: {run.path}"))
    found, hints = findings(advise(figures))
    if found:
        print(f"{len(found)} finding{'s' if len(found) != 1 else ''} from the logged series, most important first:")
        for i, advice in enumerate(found, start=1):
            print(f"{i}. {advice}")
    else:
        print(f"no finding in the logged series: {healthy_line(figures)}")
    for hint in hints:
        print(hint_line(hint))
    live = needs_live(figures)
    if live:
        print(f"not checked (they need the live callback, `AmpAdvisor`): {', '.join(live)}")
    if not figures.plugin_args and any(a.fix.startswith(f"{figures.plugin}(") for a in found):
        why = f" ({run.hparams_note})" if run.hparams_note else ""
        print(
            f"note: the run's plugin call was not found in its hparams.yaml{why}: each fix shows its one change;"
            " keep the other arguments you gave (`LossScaleMonitor` logs the call as `amp/plugin`)."
        )
    return 0


def _printable(text: str) -> str:
    """``text`` as stdout can write it: a file name's undecodable bytes escaped (stderr escapes them itself)."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _same_path(given: str, run: str) -> bool:
    """Whether ``run`` (a run folder, its metrics.csv or an event file) is the path the user gave."""
    given, run = os.path.normpath(given), os.path.normpath(run)
    return given in (run, os.path.dirname(run)) and (given == run or os.path.basename(run) == "metrics.csv")


if __name__ == "__main__":
    raise SystemExit(main())
