"""Command line: ``python -m lightning_amp_plus plot PATH [-o OUT.png]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lightning_amp_plus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
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
