"""Scale-curve plots: from a :class:`ScaleHistory`, a CSVLogger run or a TensorBoard run (``[plot]`` extra).

Reading and drawing need only the standard library, matplotlib and (for TensorBoard runs) tensorboard: this module
imports neither torch nor Lightning, so ``lightning-amp-plus plot`` starts in well under a second.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_amp_plus._series import held, prefix_of, scale_changes, scale_key, skipped_steps, value_at

if TYPE_CHECKING:
    from lightning_amp_plus.history import ScaleHistory

PathLike = Union[str, "os.PathLike[str]"]
#: what `LossScaleMonitor` logs in a bf16-mixed run, where no scale exists (NaNSkipReporter's keys alone say nothing)
_BF16_KEYS = ("applied_steps", "skip_rate")
_LOSS_KEYS = ("train_loss", "train_loss_step", "loss", "train/loss")
#: the series that say which updates a run logged (an event file's span), whatever their prefix
_RUN_KEYS = ("loss_scale", "skipped_steps", "applied_steps", "step_skipped")
_EXPECTED = (
    "expected a CSVLogger version folder, a metrics.csv, a ScaleHistory.to_csv() file, or a TensorBoard log folder"
)
_LISTED = 20


@dataclass
class RunCurves:
    """What a plot shows: the scale change points, the skipped steps and (optionally) the training loss.

    ``scaled`` is False for a bf16-mixed run: there is no loss scale, only skipped updates (and the loss).
    ``underflow`` and ``headroom`` are ``GradUnderflowMonitor``'s ``amp/underflow_fraction`` and
    ``amp/headroom_bits``, drawn in a panel of their own when logged.
    """

    scale: list[tuple[int, float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    loss: list[tuple[int, float]] = field(default_factory=list)
    scaled: bool = True
    last_step: Optional[int] = None
    underflow: list[tuple[int, float]] = field(default_factory=list)
    headroom: list[tuple[int, float]] = field(default_factory=list)


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

    16-mixed: the scale as a step curve on a log2 axis with the skipped steps marked; below it, when logged, the
    underflow fraction and the headroom (``GradUnderflowMonitor``), then the loss.
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
    gradients = curves.scaled and bool(curves.underflow or curves.headroom)
    panels = 1 + gradients + bool(curves.scaled and curves.loss)
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
    if gradients:
        _draw_gradients(axes[1][0], curves)
    if curves.scaled and curves.loss:
        lax = axes[-1][0]
        lax.plot([s for s, _ in curves.loss], [v for _, v in curves.loss], color="tab:green")
        lax.set_ylabel("training loss")
        lax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("logger step")  # the step the logger wrote (Lightning's `self.log` step), as logged
    fig.tight_layout()
    return fig


def _draw_gradients(ax: Any, curves: RunCurves) -> None:
    """The underflow fraction (left axis, 0 to 1) and the headroom in bits (right axis), at their measured steps."""
    lines = []
    if curves.underflow:
        lines += ax.plot(
            [s for s, _ in curves.underflow],
            [v for _, v in curves.underflow],
            color="tab:purple",
            marker=".",
            label="underflow fraction",
        )
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel("underflow fraction")
    ax.grid(alpha=0.3)
    if curves.headroom:
        right = ax.twinx()
        lines += right.plot(
            [s for s, _ in curves.headroom],
            [v for _, v in curves.headroom],
            color="tab:orange",
            marker=".",
            linestyle="--",
            label="headroom (bits)",
        )
        right.set_ylabel("headroom (bits)")
    ax.legend(lines, [line.get_label() for line in lines])


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
    """Read the curves of the one run at ``path`` (see :func:`read_logged`); an error names ``path``."""
    with naming(path):
        run = read_logged(path)
    with naming(run.path):  # what its series hold is the run's file's
        return _from_series(run.series, run.path)


def read_series(path: PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every finite scalar series of the one run at ``path`` (see :func:`read_logged`)."""
    return read_logged(path).series


@dataclass
class LoggedRun:
    """One logged run, read back: where from, its finite scalar series and its hyperparameters.

    ``path`` is the run's ``metrics.csv``, TensorBoard folder or event file. ``hparams`` holds what the run's
    ``hparams.yaml`` holds (``LossScaleMonitor`` logs the plugin's call there as ``amp/plugin``); ``hparams_note``
    says why none could be read, when a file was there.
    """

    path: str
    series: dict[str, list[tuple[int, float]]]
    hparams: dict[str, Any] = field(default_factory=dict)
    hparams_note: Optional[str] = None


def read_logged(path: PathLike) -> LoggedRun:
    """Read one run: a CSVLogger version folder, a ``metrics.csv``, a TensorBoard run folder or event file.

    A folder that holds no run itself but one run below is read as that run. Runs are never merged: a folder that
    holds several (``lightning_logs/`` with ``version_0`` and ``version_1``), or TensorBoard event files whose steps
    overlap (two fits into one folder), is an error that lists them.
    """
    path = os.fspath(path)
    run = _the_run(path)
    series = _read_csv(run) if _is_csv(run) else _read_tensorboard(run)
    hparams, note = _read_hparams(run if os.path.isdir(run) else os.path.dirname(run))
    return LoggedRun(run, series, hparams, note)


def find_runs(folder: PathLike) -> list[str]:
    """The run folders at or below ``folder``: each holds a ``metrics.csv`` or TensorBoard event files itself.

    A run folder is not searched further (a run's own subfolders are part of it).
    """
    found = []
    for here, folders, files in os.walk(os.fspath(folder)):
        folders.sort()
        if "metrics.csv" in files or any(_is_events(f) for f in files):
            found.append(os.path.normpath(here))
            folders[:] = []
    return found


@contextlib.contextmanager
def naming(path: PathLike) -> Iterator[None]:
    """Re-raise a ``ValueError`` or ``OSError`` that does not name ``path`` with ``path`` in front of its message."""
    where = os.fspath(path)
    try:
        yield
    except (ValueError, OSError) as error:
        if where in str(error):
            raise
        try:
            named = type(error)(f"{where}: {error}")
        except TypeError:  # an error class that takes more than a message (UnicodeDecodeError)
            named = ValueError(f"{where}: {error}")
        raise named from None


def the_run(path: PathLike) -> str:
    """The one run at ``path``: its ``metrics.csv``, event file or event folder.

    Raises an error where there is none or several.
    """
    return _the_run(os.fspath(path))


def _the_run(path: str) -> str:
    """The one run at ``path``: a ``.csv`` file, an event file, or a folder holding event files itself."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist: {_EXPECTED}.")
    if os.path.isfile(path):
        if _is_csv(path) or _is_events(os.path.basename(path)):
            return path
        raise FileNotFoundError(f"no metrics found at {path!r}: {_EXPECTED}.")
    runs = find_runs(path)
    if not runs:
        raise FileNotFoundError(f"no metrics found at {path!r} or below it: {_EXPECTED}.")
    if len(runs) > 1:
        raise ValueError(_pick_one(f"{path!r} holds {len(runs)} runs", runs))
    folder = runs[0]
    csv_path = os.path.join(folder, "metrics.csv")
    return csv_path if os.path.isfile(csv_path) else folder


def _pick_one(what: str, choices: list[str]) -> str:
    """``what``, then the choices one a line: runs are never merged, the user picks one."""
    shown = "".join(f"\n  {c}" for c in choices[:_LISTED])
    more = f"\n  ... and {len(choices) - _LISTED} more" if len(choices) > _LISTED else ""
    return f"{what}: give one of them (runs are never merged):{shown}{more}"


def plot_run(path: PathLike, output: Optional[PathLike] = None) -> str:
    """Plot a logged run to a PNG (default: ``loss_scale.png`` beside the metrics); returns its path."""
    curves = read_run(path)
    if output is None:
        base = os.fspath(path)
        folder = base if os.path.isdir(base) else os.path.dirname(base)
        output = os.path.join(folder, "loss_scale.png")
    # a file name's undecodable bytes (surrogates) escaped: a font draws text only
    shown = os.fspath(path).encode("utf-8", "backslashreplace").decode("utf-8")
    return plot_curves(curves, output, title=f"loss scale: {shown}")


def _from_series(series: dict[str, list[tuple[int, float]]], where: Optional[str] = None) -> RunCurves:
    key = scale_key(series)
    if key is None:
        bf16_key = next((k for k in sorted(series) for end in _BF16_KEYS if k.endswith(end)), None)
        if bf16_key is None:
            raise ValueError(
                f"{f'{where}: ' if where else ''}no loss-scale series found ({holds(where, series)}); log it with"
                " `LossScaleMonitor`."
            )
        # a bf16-mixed run: `LossScaleMonitor` logs its skips but no scale, which does not exist there
        prefix = next(bf16_key[: -len(end)] for end in _BF16_KEYS if bf16_key.endswith(end))
        curves = RunCurves(scaled=False, last_step=max(s for s, _ in series[bf16_key]))
        _read_skips(series, prefix, curves)
        _read_loss(series, curves)
        return curves
    changes = scale_changes(series, key)
    curves = RunCurves(scale=held(changes, max((s for s, _ in series[key]), default=None)))
    prefix = prefix_of(key)
    _read_skips(series, prefix, curves)
    _read_loss(series, curves)
    curves.underflow = sorted(series.get(prefix + "underflow_fraction", []))
    curves.headroom = sorted(series.get(prefix + "headroom_bits", []))
    return curves


def _read_skips(series: dict[str, list[tuple[int, float]]], prefix: str, curves: RunCurves) -> None:
    curves.skipped = skipped_steps(series, prefix) or []


def _read_loss(series: dict[str, list[tuple[int, float]]], curves: RunCurves) -> None:
    loss_key = next((k for k in _LOSS_KEYS if k in series), None)
    if loss_key is not None:
        curves.loss = sorted(series[loss_key])


def _read_csv(path: str) -> dict[str, list[tuple[int, float]]]:
    try:
        return _history_export(_read_csv_rows(path))
    except csv.Error as error:  # a field over csv's limit, a NUL byte, ...: not a metrics.csv we can read
        raise ValueError(f"{path}: not a readable CSV file ({error}).") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a metrics.csv ({_not_utf8(path)}).") from None


def _history_export(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """``ScaleHistory.to_csv``'s columns (``step,scale,skipped``) as the series ``LossScaleMonitor`` logs."""
    if not series or not set(series) <= {"scale", "skipped"} or "skipped" not in series:
        return series
    marks = sorted(series["skipped"])
    count, applied = 0, []
    for step, skipped in marks:
        count += int(skipped > 0)
        applied.append((step, float(step + 1 - count)))
    exported = {"step_skipped": marks, "applied_steps": applied}
    return {**exported, "loss_scale": series["scale"]} if "scale" in series else exported


def _not_utf8(path: str) -> str:
    """Where a file that failed to decode stops being UTF-8 (a text reader's error counts from its last chunk)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start}"
    return "not UTF-8 text"


def holds(path: Optional[str], series: dict[str, list[tuple[int, float]]]) -> str:
    """What a logged run holds, for an error that it lacks a series: its keys, or a CSV's columns where none has one.

    Example:
        >>> holds(None, {"loss": [(0, 1.0)], "acc": [(0, 0.5)]})
        "keys: ['acc', 'loss']"
    """
    if series or path is None or not path.endswith(".csv") or not os.path.isfile(path):
        return f"keys: {sorted(series)[:10]}"
    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), None)
    if not header:
        return "the file is empty"
    return f"its columns: {header[:10]}, none with a number at a step"


def _read_csv_rows(path: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="", encoding="utf-8-sig") as f:  # a BOM, as a spreadsheet saves it, is no column
        reader = csv.DictReader(f)
        if reader.fieldnames and "step" not in reader.fieldnames:
            raise ValueError(
                f"{path}: no `step` column (its columns: {list(reader.fieldnames)[:10]}): not a metrics.csv as"
                " Lightning's `CSVLogger` writes it."
            )
        for row in reader:
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


def _read_tensorboard(run: str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a TensorBoard event file, or of a run folder's own event files.

    A fit resumed into the same folder writes a second file that continues the first: their series join. Files
    whose logged updates overlap are two fits: an error that lists them.
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise ImportError(
            f"reading the TensorBoard run {run!r} needs tensorboard: `pip install 'lightning-amp-plus[tensorboard]'`."
        ) from err
    files = sorted(os.path.join(run, f) for f in os.listdir(run) if _is_events(f)) if os.path.isdir(run) else [run]
    per_file = []
    for events in files:
        acc = EventAccumulator(events, size_guidance={"scalars": 0})
        acc.Reload()
        series: dict[str, list[tuple[int, float]]] = {}
        for tag in acc.Tags()["scalars"]:
            values = ((e.step, float(e.value)) for e in acc.Scalars(tag))
            series[tag] = [(s, v) for s, v in values if math.isfinite(v)]  # as the CSV reader
        per_file.append(series)
    spans = [_update_span(series) for series in per_file]
    ordered = sorted((span, i) for i, span in enumerate(spans) if span is not None)
    for first, second in zip(ordered, ordered[1:], strict=False):
        if second[0][0] <= first[0][1]:
            raise ValueError(
                _pick_one(
                    f"{run!r} holds {len(files)} TensorBoard event files whose logged updates overlap (two fits"
                    " into one folder)",
                    files,
                )
            )
    merged: dict[str, list[tuple[int, float]]] = {}
    for series in per_file:
        for tag, points in series.items():
            merged.setdefault(tag, []).extend(points)
    return merged


def _update_span(series: dict[str, list[tuple[int, float]]]) -> Optional[tuple[int, int]]:
    """The first and last step of the updates an event file logged (its ``LossScaleMonitor`` series)."""
    steps = [s for key, points in series.items() if key.endswith(_RUN_KEYS) for s, _ in points]
    return (min(steps), max(steps)) if steps else None


def _is_events(name: str) -> bool:
    return name.startswith("events.out.tfevents")


def _is_csv(path: str) -> bool:
    return os.path.splitext(path)[1].lower() == ".csv"


def _read_hparams(folder: str) -> tuple[dict[str, Any], Optional[str]]:
    """A run folder's ``hparams.yaml``, and why it could not be read.

    CSVLogger and TensorBoardLogger write it beside the series (in a TensorBoard ``sub_dir`` too).
    """
    path = os.path.join(folder, "hparams.yaml")
    if not os.path.exists(path):
        return {}, None
    try:
        import yaml

        with open(path, encoding="utf-8") as f:
            loaded = yaml.load(f, Loader=_hparams_loader())  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        return {}, f"{path}: {_not_utf8(path)}"
    except Exception as error:  # noqa: BLE001 - a file we only read hints from: its problem is told, not raised
        return {}, f"{path}: not readable YAML ({type(error).__name__})"
    if not isinstance(loaded, dict):
        return {}, f"{path}: not a mapping of hyperparameters"
    return loaded, None


def _hparams_loader() -> Any:
    """PyYAML's ``SafeLoader``, reading the Python tags Lightning writes for a module's own hparams as plain data."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def plain(loader: Any, suffix: str, node: Any) -> Any:
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node)
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node)
        return loader.construct_scalar(node)

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", plain)
    Loader.add_multi_constructor("!", plain)
    return Loader
