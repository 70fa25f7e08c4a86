"""The command line: ``lightning-amp-plus`` (or ``python -m lightning_amp_plus``).

Commands import what they need when they run: ``--help`` and ``--version`` import neither torch nor Lightning.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from lightning_amp_plus.__about__ import __version__

DESCRIPTION = """\
lightning-amp-plus: visible, controllable and safe mixed precision for PyTorch Lightning.

commands:
  plot PATH [-o OUT.png]   draw the loss-scale curve (and the skipped updates) of a CSVLogger version folder,
                           a metrics.csv, or a TensorBoard log folder

examples:
  lightning-amp-plus plot lightning_logs/version_0 -o loss_scale.png
  python -m lightning_amp_plus --version
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="lightning-amp-plus", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"lightning-amp-plus {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plot = sub.add_parser("plot", help="plot the loss-scale curve of a CSVLogger or TensorBoard run")
    plot.add_argument("path", help="a CSVLogger version folder, a metrics.csv, or a TensorBoard log folder")
    plot.add_argument("-o", "--output", default=None, help="the PNG to write (default: loss_scale.png beside PATH)")
    args = parser.parse_args(argv)
    if args.command == "plot":
        from lightning_amp_plus.plot import plot_run

        try:
            out = plot_run(args.path, args.output)
        except (ImportError, OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
