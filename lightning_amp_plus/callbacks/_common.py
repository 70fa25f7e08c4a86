"""What the callbacks share: finding the plugin, logging to every logger."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_amp_plus._identity import clean_name, resolve_module
from lightning_amp_plus._ranks import distributed
from lightning_amp_plus._repr import same_value
from lightning_amp_plus._series import held
from lightning_amp_plus.advice import RunFigures
from lightning_amp_plus.knobs import DEFAULTS
from lightning_amp_plus.precision import AmpPlusPrecision


def find_plugin(trainer: pl.Trainer, owner: str) -> AmpPlusPrecision:
    """The trainer's :class:`AmpPlusPrecision`, or a ``ValueError`` that says how to add it."""
    plugin = trainer.strategy.precision_plugin
    if not isinstance(plugin, AmpPlusPrecision):
        raise ValueError(
            f"`{owner}` needs the `AmpPlusPrecision` plugin, but the trainer uses {type(plugin).__name__}."
            " HINT: `Trainer(plugins=[AmpPlusPrecision('16-mixed')])` (and no `precision=` flag)."
        )
    return plugin


def run_figures(plugin: Any, origins: list[dict[str, Any]], **measured: Any) -> RunFigures:
    """What the plugin's history and the skips' origins say of a run (the advisor adds what its callbacks measured).

    The one place both the advisor and the reporter's collapse build what :func:`~lightning_amp_plus.advice.advise`
    reads.
    """
    history, scaler = plugin.history, plugin.scaler
    # `auto_islands` measured these: run in float32 they made inf/nan again (the model's own, never an island)
    auto = getattr(plugin, "_auto", None)
    own = set(getattr(auto, "own", None) or ())
    if own:
        origins = [
            {**o, "float32": "nonfinite"}
            if o and o.get("phase") == "forward" and o.get("module") in own and not o.get("float32")
            else o
            for o in origins
        ]
    return RunFigures(
        precision=plugin.precision,
        num_updates=history.num_steps,
        last_step=history.last_step,
        curve=held(history.curve(), history.last_step) if history.scaled else [],
        skipped=history.skipped_steps,
        knobs=scaler.knobs() if scaler is not None else None,
        origins=list(origins),
        bf16_available=bf16_available(plugin.device),
        plugin=type(plugin).__name__,
        plugin_args=plugin_arguments(plugin),
        auto_islands=tuple(getattr(auto, "added", None) or ()),
        auto_fix=_auto_fix(plugin),
        **measured,
    )


def _auto_fix(plugin: Any) -> Optional[str]:
    """The plugin's own next-run line for the islands ``auto_islands`` added (None: none, or not that plugin)."""
    fix = getattr(plugin, "auto_islands_fix", None)
    line = fix() if callable(fix) else None
    return line if isinstance(line, str) else None


def bf16_available(device: Optional[str]) -> bool:
    """Whether bfloat16 autocast runs on ``device`` (a CUDA GPU that supports it, or CPU, XPU, MPS, HPU)."""
    if device == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return device in ("cpu", "xpu", "mps", "hpu")


def logging_interval(trainer: pl.Trainer, given: Optional[int] = None) -> int:
    """Steps between logging points: ``given``, else ``Trainer(log_every_n_steps)`` (50 where it is 0 or unset)."""
    return given or int(getattr(trainer, "log_every_n_steps", None) or 50)


def is_logging_step(step: int, interval: int) -> bool:
    """Whether ``step`` (the logger's step) is one Lightning writes ``self.log`` values at: the last of each interval.

    Lightning logs when ``(batches_that_stepped + 1) % log_every_n_steps == 0``: at 9, 19, 29 for 10.

    Example:
        >>> [s for s in range(30) if is_logging_step(s, 10)]
        [9, 19, 29]
    """
    return (step + 1) % interval == 0


def next_logging_step(after: int, interval: int) -> int:
    """The first logging step (:func:`is_logging_step`) after ``after``.

    Example:
        >>> next_logging_step(-1, 10), next_logging_step(9, 10), next_logging_step(12, 10)
        (9, 19, 19)
    """
    return ((after + 1) // interval + 1) * interval - 1


def plugin_arguments(plugin: Any) -> dict[str, Any]:
    """The arguments the user gave the plugin, as literals a fix line can repeat (classes by import path).

    A scaler given (``scaler=``) is told by its knobs, as though given to the plugin: a fix line changes one.
    """
    refresh = getattr(plugin, "_name_running_knobs", None)
    if callable(refresh):
        refresh()  # the knobs that run (a checkpoint's, or set on the scaler since)
    args = dict(getattr(plugin, "_given", {}))
    if args.pop("scaler", None) is not None:
        knobs = plugin.scaler.knobs()  # the scaler in use: set later (`plugin.scaler = ...`) it is that one
        if isinstance(knobs, dict):  # a bare mock holds none
            args.update({k: v for k, v in knobs.items() if not same_value(v, DEFAULTS[k])})
    if args.get("fp32_modules"):
        args["fp32_modules"] = [
            e if isinstance(e, str) else f"{e.__module__}.{e.__qualname__}" for e in args["fp32_modules"]
        ]
    return args


def log_to_all(trainer: pl.Trainer, metrics: dict[str, Any], step: int) -> None:
    """Log ``metrics`` at ``step`` to every logger of the trainer, from rank zero only."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def check_writable(owner: str, name: str, path: Any) -> None:
    """Check at setup that a report can be written at ``path``: not a folder, its folder creatable and writable.

    Creates the folder and a temporary file in it (removed at once): what the file system refuses now is an error
    now, with the argument and the reason, not a failure after the last step.
    """
    target = os.path.abspath(os.fspath(path))
    if os.path.isdir(target):
        raise ValueError(f"`{owner}({name}={os.fspath(path)!r})` is invalid: it is a folder; expected a file path.")
    folder = os.path.dirname(target)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as error:
        raise ValueError(
            f"`{owner}({name}={os.fspath(path)!r})` is invalid: its folder is not writable ({error})."
        ) from error


def _umask() -> int:
    """The process's umask: read from ``/proc`` where it can be, else set and restored at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def write_json_atomically(path: Any, data: Any) -> None:
    """Write ``data`` as JSON to a temporary file beside ``path``, then rename it into place (never half a file)."""
    write_text_atomically(path, json.dumps(data, indent=2))


def write_text_atomically(path: Any, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place, with the user's umask."""
    target = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # the user's umask, like every other file (mkstemp makes it 0600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# ---------------------------------------------------------------------------------------------- sharded gradients
def named_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters with the user's names (call it after sharding: FSDP2 replaces the parameters).

    The module is resolved first (Fabric's, DDP's and ``torch.compile``'s wrappers), then FSDP's and activation
    checkpointing's prefixes inside it are dropped.
    """
    return [(clean_name(n), p) for n, p in resolve_module(module).named_parameters()]


def parameters_and_names(module: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], dict[int, str]]:
    """:func:`named_parameters` and the name of each parameter by ``id``: the one name map the callbacks keep."""
    params = named_parameters(module)
    return params, {id(p): n for n, p in params}


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard; a plain tensor as it is)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def shards_gradients(trainer: Optional[pl.Trainer]) -> bool:
    """Whether each rank holds only a shard of every gradient (FSDP, FSDP2): figures must be reduced over ranks."""
    if trainer is None or not distributed():
        return False
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))
