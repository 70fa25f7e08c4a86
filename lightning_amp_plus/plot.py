"""Scale-curve plots: from a :class:`ScaleHistory`, a CSVLogger run or a TensorBoard run (``[plot]`` extra).

Reading and drawing need only the standard library, matplotlib and (for TensorBoard runs) tensorboard: this module
imports neither torch nor Lightning, so ``lightning-amp-plus plot`` starts in well under a second.
"""

from __future__ import annotations

import csv
import glob
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_amp_plus._series import held, prefix_of, scale_changes, scale_key, skipped_steps, value_at

if TYPE_CHECKING:
    from lightning_amp_plus.history import ScaleHistory

PathLike = Union[str, "os.PathLike[str]"]
#: what `LossScaleMonitor` logs in a bf16-mixed run, where no scale exists (NaNSkipReporter's keys alone say nothing)
_BF16_KEYS = ("applied_steps", "skip_rate")
_LOSS_KEYS = ("train_loss", "train_loss_step", "loss", "train/loss")


@dataclass
class RunCurves:
    """What a plot shows: the scale change points, the skipped steps and (optionally) the training loss.

    ``scaled`` is False for a bf16-mixed run: there is no loss scale, only skipped updates (and the loss).
    """

    scale: list[tuple[int, float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    loss: list[tuple[int, float]] = field(default_factory=list)
    scaled: bool = True
    last_step: Optional[int] = None


def _figure_class() -> Any:
    """The matplotlib ``Figure`` class: drawn and saved without pyplot (the user's backend and figures untouched)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "plotting needs matplotlib: install the plot extra with `pip install 'lightning-amp-plus[plot]'`."
        ) from err
    return Figure


def draw(curves: RunCurves, title: str = "loss scale") -> Any:
    """The matplotlib ``Figure`` of ``curves`` (not registered with pyplot): what :func:`plot_curves` writes.

    16-mixed: the scale as a step curve on a log2 axis with the skipped steps marked, and the loss below when logged.
    bf16-mixed (``curves.scaled`` False): no scale panel (there is no scale); the loss with the skipped steps
    marked on it, or, with no loss, the count of skipped updates.
    """
    if curves.scaled and not curves.scale:
        raise ValueError("nothing to plot: no loss-scale values were found (log them with `LossScaleMonitor`).")
    if not curves.scaled and not (curves.loss or curves.skipped or curves.last_step is not None):
        raise ValueError(
            "nothing to plot: a bf16-mixed run has no loss scale, and neither its updates nor a training loss"
            " (`train_loss`) were logged."
        )
    panels = 2 if (curves.scaled and curves.loss) else 1
    fig = _figure_class()(figsize=(8, 3.2 * panels))
    axes = fig.subplots(panels, sharex=True, squeeze=False)
    ax = axes[0][0]
    last = max([*(s for s, _ in curves.scale), *curves.skipped, *(s for s, _ in curves.loss), curves.last_step or 0])
    count = len(curves.skipped)
    label = f"skipped ({count})"
    if curves.scaled:
        steps = [s for s, _ in curves.scale]
        values = [v for _, v in curves.scale]
        ax.step([*steps, last], [*values, values[-1]], where="post", color="tab:blue", label="loss scale")
        ax.set_yscale("log", base=2)
        if curves.skipped:
            at = [value_at(curves.scale, s) for s in curves.skipped]
            ax.scatter(curves.skipped, at, marker="x", color="tab:red", zorder=3, label=label)
        ax.set_ylabel("loss scale (log2)")
        ax.set_title(title)
    elif curves.loss:
        ax.plot([s for s, _ in curves.loss], [v for _, v in curves.loss], color="tab:green", label="training loss")
        if curves.skipped:
            at = [value_at(curves.loss, s) for s in curves.skipped]
            ax.scatter(curves.skipped, at, marker="x", color="tab:red", zorder=3, label=label)
        ax.set_ylabel("training loss")
        ax.set_title(f"{title} (bf16-mixed: no loss scale)")
    else:
        ax.step(
            [0, *curves.skipped, last], [0, *range(1, count + 1), count], where="post", color="tab:red", label=label
        )
        ax.set_ylabel("skipped updates")
        ax.set_title(f"{title} (bf16-mixed: no loss scale)")
    ax.legend()
    ax.grid(which="both", alpha=0.3)  # on: matplotlib turns the grid on when given its style
    if panels == 2:
        lax = axes[1][0]
        lax.plot([s for s, _ in curves.loss], [v for _, v in curves.loss], color="tab:green")
        lax.set_ylabel("training loss")
        lax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("logger step")  # the step the logger wrote (Lightning's `self.log` step), as logged
    fig.tight_layout()
    return fig


def plot_curves(curves: RunCurves, output: PathLike, title: str = "loss scale") -> str:
    """Write a PNG of :func:`draw`'s figure.

    Returns the path written: ``output``, with ``.png`` added when it has no extension. A folder that does not
    exist is an error naming it (never created: a mistyped path should not make a tree of folders).
    """
    out = _output_path(os.fspath(output))
    fig = draw(curves, title)
    fig.savefig(out, dpi=110)
    return out


def _output_path(out: str) -> str:
    """The PNG path to write: ``.png`` added when ``out`` has no extension; a folder, or a missing one, refused.

    Checked before anything is drawn, each error naming the path. A missing folder is not created: a mistyped
    path should not make a tree of folders.
    """
    if os.path.isdir(out):
        raise IsADirectoryError(
            f"cannot write the plot to {out!r}: it is a folder; give a file path such as"
            f" {os.path.join(out, 'loss_scale.png')!r}."
        )
    if not os.path.splitext(out)[1]:
        out += ".png"  # what matplotlib would write anyway: say the path actually written
    folder = os.path.dirname(out)
    if folder and not os.path.isdir(folder):
        why = "is not a folder" if os.path.exists(folder) else "does not exist (create it first)"
        raise FileNotFoundError(f"cannot write the plot to {out!r}: the folder {folder!r} {why}.")
    return out


def plot_history(history: ScaleHistory, output: PathLike, loss: Optional[list[tuple[int, float]]] = None) -> str:
    """Plot a :class:`ScaleHistory` (and optionally ``(step, loss)`` pairs) to a PNG; returns its path."""
    return plot_curves(history_curves(history, loss), output)


def history_curves(history: ScaleHistory, loss: Optional[list[tuple[int, float]]] = None) -> RunCurves:
    """What :func:`plot_history` draws: the change points up to the last recorded step, the skips, the loss."""
    scaled = history.scaled
    return RunCurves(
        scale=held(history.curve(), history.last_step) if scaled else [],
        skipped=history.skipped_steps,
        loss=list(loss or []),
        scaled=scaled,
        last_step=history.last_step,
    )


def read_run(path: PathLike) -> RunCurves:
    """Read the curves from a CSVLogger version folder, a ``metrics.csv``, or a TensorBoard log folder."""
    return _from_series(read_series(path))


def read_series(path: PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every finite scalar series of a CSVLogger version folder, a ``metrics.csv`` or a TensorBoard log folder."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path!r} does not exist: expected a CSVLogger version folder, a metrics.csv, or a TensorBoard log folder."
        )
    if os.path.isfile(path) and path.endswith(".csv"):
        return _read_csv(path)
    if os.path.isdir(path):
        csv_path = os.path.join(path, "metrics.csv")
        if os.path.isfile(csv_path):
            return _read_csv(csv_path)
        if glob.glob(os.path.join(path, "**", "events.out.tfevents*"), recursive=True):
            return _read_tensorboard(path)
    if os.path.isfile(path) and "tfevents" in os.path.basename(path):
        return _read_tensorboard(os.path.dirname(path))
    raise FileNotFoundError(
        f"no metrics found at {path!r}: expected a CSVLogger version folder, a metrics.csv,"
        " or a TensorBoard log folder."
    )


def plot_run(path: PathLike, output: Optional[PathLike] = None) -> str:
    """Plot a logged run to a PNG (default: ``loss_scale.png`` beside the metrics); returns its path."""
    curves = read_run(path)
    if output is None:
        base = os.fspath(path)
        folder = base if os.path.isdir(base) else os.path.dirname(base)
        output = os.path.join(folder, "loss_scale.png")
    return plot_curves(curves, output, title=f"loss scale: {os.fspath(path)}")


def _from_series(series: dict[str, list[tuple[int, float]]]) -> RunCurves:
    key = scale_key(series)
    if key is None:
        bf16_key = next((k for k in sorted(series) for end in _BF16_KEYS if k.endswith(end)), None)
        if bf16_key is None:
            raise ValueError(
                f"no loss-scale series found (keys: {sorted(series)[:10]}); log it with `LossScaleMonitor`."
            )
        # a bf16-mixed run: `LossScaleMonitor` logs its skips but no scale, which does not exist there
        prefix = next(bf16_key[: -len(end)] for end in _BF16_KEYS if bf16_key.endswith(end))
        curves = RunCurves(scaled=False, last_step=max(s for s, _ in series[bf16_key]))
        _read_skips(series, prefix, curves)
        _read_loss(series, curves)
        return curves
    changes = scale_changes(series, key)
    curves = RunCurves(scale=held(changes, max((s for s, _ in series[key]), default=None)))
    _read_skips(series, prefix_of(key), curves)
    _read_loss(series, curves)
    return curves


def _read_skips(series: dict[str, list[tuple[int, float]]], prefix: str, curves: RunCurves) -> None:
    curves.skipped = skipped_steps(series, prefix) or []


def _read_loss(series: dict[str, list[tuple[int, float]]], curves: RunCurves) -> None:
    loss_key = next((k for k in _LOSS_KEYS if k in series), None)
    if loss_key is not None:
        curves.loss = sorted(series[loss_key])


def _read_csv(path: str) -> dict[str, list[tuple[int, float]]]:
    try:
        return _read_csv_rows(path)
    except csv.Error as error:  # a field over csv's limit, a NUL byte, ...: not a metrics.csv we can read
        raise ValueError(f"{path}: not a readable CSV file ({error}).") from None


def _read_csv_rows(path: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if None in row:
                raise ValueError(f"{path}: a row has more fields than the header ({row[None]!r}): not a metrics.csv?")
            if not row.get("step"):
                continue
            try:
                step = float(row["step"])
            except ValueError:
                raise ValueError(f"{path}: step {row['step']!r} is not a number.") from None
            if not (math.isfinite(step) and step >= 0 and step == int(step)):
                raise ValueError(f"{path}: step {row['step']!r} is not a step index (expected an int >= 0).")
            step = int(step)
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                try:
                    number = float(value)
                except ValueError:
                    continue
                if math.isfinite(number):
                    series.setdefault(key, []).append((step, number))
    return series


def _read_tensorboard(folder: str) -> dict[str, list[tuple[int, float]]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise ImportError(
            "reading TensorBoard logs needs tensorboard: `pip install 'lightning-amp-plus[tensorboard]'`."
        ) from err
    series: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(glob.glob(os.path.join(folder, "**", "events.out.tfevents*"), recursive=True)):
        acc = EventAccumulator(events, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            values = ((e.step, float(e.value)) for e in acc.Scalars(tag))
            series.setdefault(tag, []).extend((s, v) for s, v in values if math.isfinite(v))  # as the CSV reader
    return series
