"""ScaleHistory: a device-side step record compressed on the host into change points and skipped steps.

Torch only. Each recorded step writes two numbers (the scale the step used, its overflow flag) into a small
device buffer without a host sync; :meth:`ScaleHistory.flush` moves the buffer to the host in one transfer and
keeps only what carries information: the steps where the scale changed and the steps that were skipped. The
history is therefore O(scale changes + skips), not O(steps).
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_amp_plus._series import value_at
from lightning_amp_plus._validation import check_int, is_int, is_real
from lightning_amp_plus.syncs import to_host

_STATE_VERSION = 2


class ScaleHistory:
    """The loss-scale curve and the skipped steps of a run.

    A *step* is the caller's step index (in Lightning, the step the logger uses for ``self.log`` in that batch;
    under Fabric, the count of updates so far);
    ``scale_at(step)`` is the scale that step's backward used, i.e. the value *before* that step's update.

    Args:
        capacity: steps buffered on the device before an automatic flush (one host transfer per ``capacity`` steps
            at most, when nobody flushes earlier).
        scaled: whether the scale is a loss scale (default True); bf16-mixed histories record skips under a constant
            1.0, and plots and monitors show no scale for them.

    Example:
        >>> import torch
        >>> from lightning_amp_plus import ScaleHistory
        >>> history = ScaleHistory()
        >>> for step, (scale, overflow) in enumerate([(4.0, 0), (4.0, 1), (2.0, 0), (2.0, 0), (4.0, 0)]):
        ...     history.record(step, torch.tensor(scale), torch.tensor(float(overflow)))
        >>> history.curve()
        [(0, 4.0), (2, 2.0), (4, 4.0)]
        >>> history.skipped_steps, history.num_skipped, history.scale_at(3)
        ([1], 1, 2.0)
    """

    def __init__(self, capacity: int = 256, scaled: bool = True) -> None:
        self._capacity = check_int(type(self).__name__, "capacity", capacity, minimum=1)
        #: whether the recorded scale is a loss scale (16-mixed); bf16-mixed records 1.0, which is not one
        self.scaled = scaled
        self._pending: list[tuple[int, Tensor | float | None, Tensor | float]] = []
        self._change_steps: list[int] = []
        self._change_scales: list[float] = []
        self._skipped: list[int] = []
        self._streaks: list[int] = []  # per skipped step: the skipped updates in a row ending at it
        self._num_steps = 0
        self._last_step: int | None = None
        self._last_scale: float | None = None
        self._trailing_skips = 0

    # ------------------------------------------------------------------ recording
    def record(self, step: int, scale: Tensor | float | None, found_inf: Tensor | float) -> None:
        """Record one update: the scale its backward used and its overflow flag (> 0: skipped).

        Tensors stay on their device (no sync) and are kept as given: a scale that changes in place later must come
        as a copy (the scaler's :meth:`~lightning_amp_plus.DynamicLossScaler.close` hands one). ``scale=None`` means
        the scale of the previous record, for a caller that knows it did not change. Plain numbers are taken at once
        when nothing is pending: a run whose outcomes the host knows costs no device op here.
        """
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"`ScaleHistory.record(step={step})` is invalid: steps must increase"
                f" (last recorded: {self._last_step})."
            )
        if scale is None and self._last_scale is None and not self._pending:
            raise ValueError(f"`ScaleHistory.record(step={step}, scale=None)` is invalid: no scale recorded before.")
        self._last_step = step
        self._num_steps += 1
        if not isinstance(scale, Tensor) and not self._pending and not isinstance(found_inf, Tensor):
            previous = self._last_scale
            assert scale is not None or previous is not None  # checked above
            self._take(step, float(scale if scale is not None else previous), float(found_inf))  # type: ignore[arg-type]
            return
        self._pending.append((step, scale, found_inf))
        if len(self._pending) >= self._capacity:
            self.flush()

    def flush(self) -> None:
        """Move the pending records' tensors to the host (one transfer) and keep them. A no-op when none is pending."""
        if not self._pending:
            return
        # the first pending record holds a tensor (records of plain numbers queue only behind one)
        tensors = [v for _, scale, found in self._pending for v in (scale, found) if isinstance(v, Tensor)]
        device = tensors[0].device
        packed = torch.stack([t.to(device=device, dtype=torch.float32).reshape(()) for t in tensors])
        values: Iterator[float] = iter(to_host(packed))  # the one transfer
        for step, scale, found in self._pending:
            scale_value = next(values) if isinstance(scale, Tensor) else scale
            found_value = next(values) if isinstance(found, Tensor) else found
            if scale_value is None:  # the previous record's scale (checked at `record`)
                assert self._last_scale is not None
                scale_value = self._last_scale
            self._take(step, float(scale_value), float(found_value))
        self._pending = []

    def last_flag(self) -> tuple[int, Tensor | float] | None:
        """The last record's step and overflow flag as recorded: a device tensor while pending (not read here)."""
        if self._pending:
            step, _, found = self._pending[-1]
            return step, found
        if self._last_step is None:
            return None
        return self._last_step, float(bool(self._skipped) and self._skipped[-1] == self._last_step)

    @property
    def pending(self) -> int:
        """Records whose values are still on the device (not yet flushed to the host)."""
        return len(self._pending)

    def _take(self, step: int, scale: float, found: float) -> None:
        """Keep one record. Every record passes here once, in order: the one place that counts skips in a row."""
        if self._last_scale is None or scale != self._last_scale:
            self._change_steps.append(step)
            self._change_scales.append(scale)
            self._last_scale = scale
        if found != 0:
            self._trailing_skips += 1  # consecutive = no clean update between, however the steps are numbered
            self._skipped.append(step)
            self._streaks.append(self._trailing_skips)
        else:
            self._trailing_skips = 0

    @property
    def trailing_skips(self) -> int:
        """How many of the last flushed updates were skipped in a row (updates still on the device not counted)."""
        return self._trailing_skips

    def streak_at(self, step: int) -> int:
        """For a skipped ``step``: how many updates in a row were skipped, ending with it (flushes first).

        Updates are counted, not step numbers: two optimizers' steps in one batch, or steps the logger numbers
        apart, are consecutive when no clean update came between them.
        """
        self.flush()
        at = bisect.bisect_left(self._skipped, step)
        if at == len(self._skipped) or self._skipped[at] != step:
            raise ValueError(f"`ScaleHistory.streak_at(step={step})` is invalid: step {step} was not skipped.")
        return self._streaks[at]

    # ------------------------------------------------------------------ queries (each flushes first)
    @property
    def skipped_steps(self) -> list[int]:
        """The skipped steps, ascending."""
        self.flush()
        return list(self._skipped)

    @property
    def num_skipped(self) -> int:
        """How many steps were skipped."""
        self.flush()
        return len(self._skipped)

    @property
    def num_steps(self) -> int:
        """How many steps were recorded (skipped ones included); known on the host without a flush."""
        return self._num_steps

    @property
    def last_step(self) -> int | None:
        """The last recorded step, or ``None``."""
        return self._last_step

    def scale_at(self, step: int) -> float:
        """The scale that ``step``'s backward used (the step function through the change points)."""
        self.flush()
        if not self._change_steps or step < self._change_steps[0] or step > (self._last_step or 0):
            raise ValueError(
                f"`ScaleHistory.scale_at(step={step})` is invalid: the history covers steps"
                f" {self._change_steps[0] if self._change_steps else None} to {self._last_step}."
            )
        return value_at(self.curve(), step)

    def curve(self) -> list[tuple[int, float]]:
        """The change points ``(step, scale)``: the scale holds from each step until the next change point."""
        self.flush()
        return list(zip(self._change_steps, self._change_scales, strict=False))

    def skipped_between(self, start: int, end: int) -> list[int]:
        """The skipped steps with ``start <= step <= end``."""
        return [s for s in self.skipped_steps if start <= s <= end]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """A small, plain-Python state (flushes first)."""
        self.flush()
        return {
            "version": _STATE_VERSION,
            "change_steps": list(self._change_steps),
            "change_scales": list(self._change_scales),
            "skipped_steps": list(self._skipped),
            "skip_streaks": list(self._streaks),
            "trailing_skips": self._trailing_skips,
            "num_steps": self._num_steps,
            "last_step": self._last_step,
            "scaled": self.scaled,
        }

    def load_state_dict(self, state_dict: Any, where: str = "ScaleHistory.load_state_dict") -> None:
        """Replace this history with a saved one; every field is checked first (errors name ``where`` and the key)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"`{where}` is invalid: expected a dict, got {type(state_dict).__name__}.")
        version = state_dict.get("version")
        if version not in (1, _STATE_VERSION):
            raise ValueError(f"`{where}['version']={version!r}` is invalid: expected 1 or {_STATE_VERSION}.")
        steps = _int_list(where, state_dict, "change_steps")
        skipped = _int_list(where, state_dict, "skipped_steps")
        scales = state_dict.get("change_scales")
        if (
            not isinstance(scales, list)
            or len(scales) != len(steps)
            or not all(is_real(v) and math.isfinite(v) and v > 0 for v in scales)
        ):
            raise ValueError(
                f"`{where}['change_scales']={scales!r:.120}` is invalid: expected a list of finite numbers > 0, one"
                " per change step."
            )
        num_steps, last_step = state_dict.get("num_steps"), state_dict.get("last_step")
        if not is_int(num_steps) or num_steps < len(skipped):
            raise ValueError(
                f"`{where}['num_steps']={num_steps!r}` is invalid: expected an int >= the {len(skipped)} skipped steps."
            )
        if last_step is None and num_steps:
            raise ValueError(f"`{where}['last_step']=None` is invalid with num_steps={num_steps}.")
        if last_step is not None and (not is_int(last_step) or any(step > last_step for step in steps + skipped)):
            raise ValueError(
                f"`{where}['last_step']={last_step!r}` is invalid: expected an int >= every recorded step."
            )
        streaks, trailing = _streaks(where, state_dict, version, len(skipped))
        scaled = state_dict.get("scaled", True)
        if not isinstance(scaled, bool):
            raise ValueError(f"`{where}['scaled']={scaled!r}` is invalid: expected True or False.")
        self.scaled = scaled
        self._pending = []
        self._streaks = list(streaks)
        self._change_steps = steps
        self._change_scales = [float(v) for v in scales]
        self._skipped = skipped
        self._num_steps = num_steps
        self._last_step = last_step
        self._last_scale = self._change_scales[-1] if self._change_scales else None
        self._trailing_skips = trailing

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write one row per change point, skipped step and the last step: ``step,scale,skipped``.

        The scale column is empty in bf16-mixed (no scale exists). ``lightning-amp-plus plot`` and ``advise`` read it.
        """
        self.flush()
        last = [self.last_step] if self.last_step is not None else []
        steps = sorted({*self._change_steps, *self._skipped, *last})
        skipped = set(self._skipped)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "scale", "skipped"])
            curve = self.curve()
            for step in steps:
                writer.writerow([step, value_at(curve, step) if self.scaled else "", int(step in skipped)])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(steps={self._num_steps}, changes={len(self._change_steps)},"
            f" skipped={len(self._skipped)}, pending={len(self._pending)})"
        )


def _is_count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _streaks(where: str, state: dict[str, Any], version: int, skips: int) -> tuple[list[int], int]:
    """A saved history's skip streaks and trailing skips, checked (0.1.x kept none: each skip its own streak)."""
    if version == 1:
        return [1] * skips, 0
    streaks, trailing = state.get("skip_streaks"), state.get("trailing_skips")
    if not isinstance(streaks, list) or len(streaks) != skips or not all(_is_count(v) and v >= 1 for v in streaks):
        raise ValueError(
            f"`{where}['skip_streaks']={streaks!r:.120}` is invalid: expected an int >= 1 per skipped step."
        )
    last = streaks[-1] if streaks else 0
    if not _is_count(trailing) or trailing not in (0, last):
        raise ValueError(
            f"`{where}['trailing_skips']={trailing!r}` is invalid: expected 0 or the last skip's streak ({last})."
        )
    return list(streaks), trailing


def _int_list(where: str, state: dict[str, Any], key: str) -> list[int]:
    values = state.get(key)
    if (
        not isinstance(values, list)
        or not all(_is_count(v) for v in values)
        or any(b <= a for a, b in itertools.pairwise(values))
    ):
        raise ValueError(f"`{where}[{key!r}]={values!r:.120}` is invalid: expected increasing ints >= 0.")
    return list(values)
