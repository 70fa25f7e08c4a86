"""DynamicLossScaler: a bounded, hysteresis-aware ``torch.amp.GradScaler``.

Torch only (no Lightning import): usable in a plain PyTorch loop exactly like ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from lightning_amp_plus._identity import resolve_optimizer
from lightning_amp_plus._limits import scale_floor
from lightning_amp_plus._log import say
from lightning_amp_plus._repr import KnobsRepr, given_arguments
from lightning_amp_plus._validation import check_bool
from lightning_amp_plus._warnings import deprecated
from lightning_amp_plus.knobs import DEFAULTS, KNOBS, check_knobs, check_new_scale, grows, knob_values, read_checkpoint


class StepOutcome:
    """Whether one optimizer step was skipped: known on the host, or the device flags of a fused step, read on demand.

    Example:
        >>> import torch
        >>> outcome = StepOutcome(flags=[torch.tensor(0.0), torch.tensor(1.0)])
        >>> outcome.known, outcome.read(), outcome.known
        (None, True, True)
    """

    __slots__ = ("_flags", "_skipped")

    def __init__(self, skipped: bool | None = None, flags: Sequence[Tensor] = ()) -> None:
        self._skipped = skipped
        self._flags = flags

    @property
    def known(self) -> bool | None:
        """The outcome if the host knows it (no sync), else ``None``."""
        return self._skipped

    def read(self) -> bool:
        """The outcome; reads the device flags once (one host sync) if the host does not know it yet."""
        if self._skipped is None:
            self._skipped = bool(sum(flag.item() for flag in self._flags))
            self._flags = ()
        return self._skipped

    def __repr__(self) -> str:
        return f"StepOutcome({'on the device' if self._skipped is None else f'skipped={self._skipped}'})"


#: the outcomes the host knows: immutable once known, so shared
SKIPPED, APPLIED = StepOutcome(True), StepOutcome(False)


def any_skipped(outcomes: Iterable[StepOutcome], *, sync: bool) -> bool | None:
    """The one skip rule: an update is skipped when one of its steps was.

    ``None`` while a device flag is unread (``sync=False``); ``sync=True`` reads what it must.
    """
    unknown = False
    for outcome in outcomes:
        skipped = outcome.read() if sync else outcome._skipped
        if skipped:
            return True
        unknown = unknown or skipped is None
    return None if unknown else False


class UpdateRecord:
    """One update of the scale: its steps' outcomes as they come, then what the scaler's ``update`` did with them.

    The update's one place: its skip is decided here, once, and read by the rest.

    :meth:`DynamicLossScaler.last_update` gives the closed one; a subclass that overrides ``update`` calls
    ``super().update()``, which closes it.

    Attributes:
        outcomes: per optimizer (its ``id``, the real one), its step's outcome in this update.
        closed: whether ``update`` closed it. Then:
        skipped: whether it was skipped (``None``: a fused optimizer decided on the device, and nobody read it).
        flag: its overflow flag as the history records it (a device tensor when the host does not know it).
        scale: a copy of the scale its backward used (a device tensor; None when ``kept``), and ``kept``: whether
            that scale is known to be the one the update before used (nothing to record).
        scale_before: that scale read on the host, on a known skip only (the skip's report says it).
        unstepped: the optimizers (their ``id``) unscaled in it that did not step (an optimizer only clipped; a
            ``step`` override that returned without stepping). Read only when the host could not decide.
    """

    __slots__ = ("closed", "flag", "kept", "outcomes", "scale", "scale_before", "skipped", "unstepped")

    def __init__(self) -> None:
        self.outcomes: dict[int, StepOutcome] = {}
        self.closed = False
        self.skipped: bool | None = None
        self.flag: Tensor | float = 0.0
        self.scale: Tensor | None = None
        self.kept = False
        self.scale_before: float | None = None
        self.unstepped: tuple[int, ...] = ()

    def decide(self, states: dict[int, dict[str, Any]]) -> tuple[bool | None, bool | None]:
        """The update's outcome as the host knows it, no sync: (overflowed, skipped).

        ``overflowed``: whether its checked gradients held inf/nan (``states``: torch's per optimizer); None when an
        optimizer was checked without a step (clipped only) or a fused step's flag is unread. ``skipped``: whether a
        step was skipped, by :func:`any_skipped` over the steps it holds (None: a flag unread).
        """
        skipped = any_skipped(self.outcomes.values(), sync=False)
        if not states:
            return None, skipped
        for state in states.values():  # a loop, not a generator: no Python call a step
            if state["stage"] is not OptState.STEPPED:
                return None, skipped
        return skipped, skipped

    def skipped_by(self, optimizer: torch.optim.Optimizer, sync: bool) -> bool | None:
        """Whether ``optimizer``'s step in it was skipped (None: it did not step, or its flag is unread)."""
        outcome = self.outcomes.get(id(optimizer))  # the optimizer itself (the engine's): no resolving
        if outcome is None:
            outcome = self.outcomes.get(id(resolve_optimizer(optimizer)))
        if outcome is None:
            return None
        return outcome.read() if sync else outcome._skipped

    def read(self) -> bool:
        """Whether it was skipped, a fused step's flag read now (one host sync at most); a closed update keeps it."""
        skipped = bool(any_skipped(self.outcomes.values(), sync=True))
        if self.closed:
            self.skipped = skipped
        return skipped

    def close(
        self,
        skipped: bool | None,
        flag: Tensor | float,
        scale: Tensor | None,
        kept: bool,
        scale_before: float | None,
        unstepped: tuple[int, ...],
    ) -> None:
        """What ``update`` did: the record is complete."""
        self.skipped, self.flag, self.scale, self.kept, self.scale_before = skipped, flag, scale, kept, scale_before
        self.unstepped = unstepped
        self.closed = True

    def __repr__(self) -> str:
        if not self.closed:
            return f"UpdateRecord(open, {len(self.outcomes)} step{'s' if len(self.outcomes) != 1 else ''})"
        return f"UpdateRecord(skipped={self.skipped}, kept={self.kept})"


class HostMirror:
    """What the host knows of a scaler's trackers between updates, without a sync.

    A new one is the one place it starts (a new run, a loaded state, a copy). ``growth``: the device growth tracker,
    mirrored while every update's outcome is known on the host (None: not). ``kept``: the last update is known to
    have left the scale as it was.
    """

    __slots__ = ("growth", "kept")

    def __init__(self, growth: int | None = 0) -> None:
        self.growth = growth
        self.kept = False


def steps_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is fused: it takes the scale and decides its skip on the device (no host sync)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class DynamicLossScaler(torch.amp.GradScaler):
    """Dynamic loss scaler with scale bounds and hysteresis (Megatron's rule, bounded).

    Per optimizer-step cycle (one :meth:`update`):

    * overflow (inf/nan in any unscaled gradient): the step is skipped; growth tracker := 0; hysteresis tracker -= 1;
      if it is now <= 0: ``scale := max(scale * backoff_factor, min_scale)``.
    * clean step: growth tracker += 1; when it reaches ``growth_interval``: growth tracker := 0, hysteresis
      tracker := ``hysteresis``, ``scale := min(scale * growth_factor, max_scale)`` (a product that is not finite
      leaves the scale unchanged, as in torch).

    With ``min_scale=0, max_scale=inf, hysteresis=1`` it is ``torch.amp.GradScaler`` exactly. :meth:`update` runs on
    the device (no host sync). :meth:`state_dict` carries every tracker.

    A drop-in for ``torch.amp.GradScaler``: the same positional arguments (``device, init_scale, growth_factor,
    backoff_factor, growth_interval, enabled``), ours after them as keywords. Every method that takes an optimizer
    accepts a wrapper of it too (Lightning's ``LightningOptimizer``, Fabric's optimizer) and means the optimizer inside.

    Extension points: the plugins call this scaler's public :meth:`scale`, :meth:`unscale_`, :meth:`step` and
    :meth:`update` as stock Lightning calls a ``GradScaler``'s (``unscale_`` and ``step`` once per optimizer step,
    ``update`` once per update), so a subclass that overrides one of them and calls ``super()`` is called, and so is a
    mock that wraps the scaler. The plugins learn what an update did from :meth:`last_update`.

    Args:
        device: device type of the gradients, as for ``torch.amp.GradScaler`` (``"cuda"``, ``"cpu"``, ...).
        init_scale: initial scale.
        growth_factor: factor (> 1) applied after ``growth_interval`` clean steps in a row.
        backoff_factor: factor in (0, 1) applied on overflow.
        growth_interval: clean steps in a row before the scale grows.
        min_scale: the scale never backs off below this (0: below float32's smallest normal value, 2**-126).
        max_scale: the scale never grows above this.
        hysteresis: overflows tolerated (steps skipped, scale kept) before the scale backs off; a growth resets it.
        enabled: ``False`` turns every method into a pass-through, as in torch.

    Every scale, bound and factor must be one float32 can hold (the rules: :data:`~lightning_amp_plus.knobs.KNOBS`);
    :meth:`load_state_dict` checks a checkpoint's values by the same rules.

    Example:
        >>> import torch
        >>> from lightning_amp_plus import DynamicLossScaler
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=2, max_scale=2.0**11)
        >>> for _ in range(6):
        ...     with torch.autocast("cpu", dtype=torch.float16):
        ...         loss = model(torch.randn(8, 4)).float().pow(2).mean()
        ...     scaler.scale(loss).backward()
        ...     scaler.step(opt)
        ...     scaler.update()
        ...     opt.zero_grad()
        >>> scaler.get_scale()  # grew once to max_scale, then stayed there
        2048.0
    """

    #: the scale moves (a checker's never does: its value is 1, read without a sync)
    _moves = True
    # our knobs (torch's own are its attributes), set from the knob table
    _min_scale: float
    _max_scale: float
    _hysteresis: int
    _init_hysteresis_tracker: int
    _host: HostMirror  # what the host knows of the trackers between updates
    _update: UpdateRecord  # the open update (its steps' outcomes), or the last one until a step opens the next
    _last: UpdateRecord | None = None  # what the last update did

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float | None = DEFAULTS["init_scale"],
        growth_factor: float | None = DEFAULTS["growth_factor"],
        backoff_factor: float | None = DEFAULTS["backoff_factor"],
        growth_interval: int | None = DEFAULTS["growth_interval"],
        enabled: bool = True,
        *,
        min_scale: float | None = DEFAULTS["min_scale"],
        max_scale: float | None = DEFAULTS["max_scale"],
        hysteresis: int | None = DEFAULTS["hysteresis"],
    ) -> None:
        given = knob_values({name: value for name, value in locals().items() if name in DEFAULTS})
        self._given = given_arguments(DynamicLossScaler.__init__, {**locals(), **given})
        check_knobs(type(self).__name__, given)
        check_bool(type(self).__name__, "enabled", enabled)
        #: the constructor's knobs, restored by :meth:`reset` (a checkpoint may replace the live ones)
        self._constructed: dict[str, Any] = {knob.name: knob.convert(given[knob.name]) for knob in KNOBS}
        torch_knobs = {knob.name: self._constructed[knob.name] for knob in KNOBS if knob.torch}
        super().__init__(device, enabled=enabled, **torch_knobs)
        self._set_knobs(self._constructed)
        #: "any" (torch's rule: every overflow backs off) or "backward" (a skip whose loss was already inf/nan
        #: leaves the scale and its trackers alone: no scale causes it); set by the plugin
        self.backoff_on = "any"
        #: on :meth:`load_state_dict`, keep the knobs given to the constructor (a plugin's: passed on resume, meant);
        #: False (torch's rule, the default for a scaler you make): the checkpoint's knobs replace them
        self.keep_given = False
        self._loss_nonfinite: Tensor | None = None  # this cycle's losses, any inf/nan (backoff_on="backward")
        self._hysteresis_tracker: Tensor | None = None
        self._host = HostMirror()
        self._update = UpdateRecord()
        #: reduce the overflow flag over ``process_group`` wherever gradients are checked (sharded gradients)
        self._reduce_over_ranks = False
        self.process_group: Any = None

    @classmethod
    def from_grad_scaler(cls, scaler: torch.amp.GradScaler, **kwargs: Any) -> DynamicLossScaler:
        """A scaler of this class with a ``torch.amp.GradScaler``'s knobs and state (its scale, its growth tracker).

        torch's rule exactly (``min_scale=0``, ``max_scale=inf``, ``hysteresis=1``) unless ``kwargs`` set our knobs;
        ``kwargs`` also take this class's own arguments (``process_group``). A new run starts again at the scale the
        given scaler had.

        Example:
            >>> import torch
            >>> scaler = DynamicLossScaler.from_grad_scaler(torch.amp.GradScaler("cpu", init_scale=2.0**10))
            >>> scaler.get_scale(), scaler.max_scale
            (1024.0, inf)
        """
        if not scaler.is_enabled():
            raise ValueError(
                f"`{cls.__name__}.from_grad_scaler(scaler)` is invalid: the `GradScaler` is disabled"
                " (`enabled=False`), so it scales nothing. HINT: pass an enabled scaler, or use bf16-mixed."
            )
        made = cls(
            scaler._device,  # torch keeps the device type here only
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            **{"min_scale": 0.0, "max_scale": math.inf, "hysteresis": 1, **kwargs},
        )
        made.load_state_dict(scaler.state_dict())
        return made

    def _set_knobs(self, values: dict[str, Any]) -> None:
        """Set the knobs in ``values`` where the scaler keeps them (checked before)."""
        for knob in KNOBS:
            if knob.name in values:
                setattr(self, knob.attribute, knob.convert(values[knob.name]))
        if "hysteresis" in values:
            self._init_hysteresis_tracker = self._hysteresis

    # ------------------------------------------------------------------ knobs
    @property
    def min_scale(self) -> float:
        """The lower bound of the scale."""
        return self._min_scale

    @property
    def max_scale(self) -> float:
        """The upper bound of the scale."""
        return self._max_scale

    @property
    def hysteresis(self) -> int:
        """Overflows tolerated before backing off."""
        return self._hysteresis

    def _set_one(self, name: str, value: Any) -> None:
        check_knobs(f"{type(self).__name__}.set_{name}", {**self._knobs(), name: value})
        self._set_knobs({name: value})

    def set_growth_factor(self, new_factor: float) -> None:
        """Set ``growth_factor``, checked as the constructor checks it."""
        self._set_one("growth_factor", new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set ``backoff_factor``, checked as the constructor checks it."""
        self._set_one("backoff_factor", new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set ``growth_interval``, checked as the constructor checks it."""
        self._set_one("growth_interval", new_interval)

    def set_device_type(self, device: str) -> None:
        """Set the device type once it is known (a plugin built with ``device=None`` learns it from the trainer)."""
        self._device = device

    def scale_tensor(self) -> Tensor | None:
        """The current scale as a device tensor (no sync), or ``None`` before the first :meth:`scale`."""
        return self._scale if self._enabled else None

    def reset(self) -> None:
        """Back to the state the constructor made (a new run), in place: its knobs, ``init_scale``, fresh trackers."""
        self._set_knobs(self._constructed)
        self._init_growth_tracker = 0
        self._scale = None
        self._growth_tracker = None
        self._hysteresis_tracker = None
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._host = HostMirror()
        self._update = UpdateRecord()
        self._last = None

    # ------------------------------------------------------------------ lazy init
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)

    # ------------------------------------------------------------------ the steps of an update
    # Written out here, top to bottom: torch's `GradScaler.step`, `unscale_` and `update` are never entered, so no call
    # goes into torch and back into an override of ours. torch serves its helpers only (`_unscale_grads_`: the fused
    # check-and-unscale kernel by device and dtype; `_check_scale_growth_tracker`).
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale (once per cycle), as ``torch.amp.GradScaler.unscale_``.

        The plugins call it once per optimizer and update, before the hooks and clipping see the gradients.
        """
        if not self._enabled:
            return
        optimizer = resolve_optimizer(optimizer)
        if self._scale is None and self._places_scale:
            self._place_scale(optimizer)
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inverse = scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal().float()
        state["found_inf_per_device"] = self._check(optimizer, inverse, allow_fp16=False)
        state["stage"] = OptState.UNSCALED

    def _check(self, optimizer: torch.optim.Optimizer, inverse: Tensor, allow_fp16: bool) -> dict[Any, Tensor]:
        """Check ``optimizer``'s gradients for inf/nan, multiply them by ``inverse``: the overflow flag per device."""
        found_inf = torch.zeros((), dtype=torch.float32, device=inverse.device)
        return self._unscale_grads_(optimizer, inverse, found_inf, allow_fp16)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        """Torch's check-and-unscale, plus the two rules every check follows (``unscale_`` and a fused step's).

        An optimizer whose parameters received no gradient contributes a clean flag (it then steps as a no-op, as
        in 32-bit training). With sharded gradients the flags are summed over the ranks, so every rank decides alike.
        """
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not per_device:
            per_device = {found_inf.device: found_inf}
        if self._reduce_over_ranks and torch.distributed.is_available() and torch.distributed.is_initialized():
            combined = _combined(list(per_device.values()), next(iter(per_device)))
            torch.distributed.all_reduce(combined, group=self.process_group)
            per_device = {combined.device: combined}
        return per_device

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done already), then step ``optimizer`` unless its gradients hold inf/nan.

        The plugins call it once per optimizer step. The skip is decided here, once: a non-fused optimizer's flags are
        read on the host (the one sync torch's own step makes); a fused optimizer decides on the device, its outcome
        read only when asked (:meth:`step_was_skipped`), and a skipped fused step creates no optimizer state.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if id(optimizer) not in self._per_optimizer_states:  # unscaled already: the optimizer itself, resolved then
            optimizer = resolve_optimizer(optimizer)
        if self._scale is None and self._places_scale:
            self._place_scale(optimizer)
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if steps_on_device(optimizer):
            return self._fused_step(optimizer, state, args, kwargs)
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)  # the extension point: an override of it is called here, once
        if not state["found_inf_per_device"]:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        skipped = self._overflowed(state)  # the one host read torch's own step makes (made earlier by a clip: kept)
        self._stepped(optimizer, SKIPPED if skipped else APPLIED)
        retval = None if skipped else optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED  # after the step: one that raised leaves its gradients unscaled, once
        return retval

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A fused optimizer's step: it takes the scale and the flag, and skips on the device (torch's protocol)."""
        scale = self._scale
        assert scale is not None
        created_from = len(optimizer.state)
        handed = "grad_scaler" in inspect.signature(optimizer.step).parameters  # torch's older protocol
        if handed:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the near"
                " future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed optimizer and"
                " let the optimizer use them directly.",
                FutureWarning,
                stacklevel=3,
            )
            kwargs["grad_scaler"] = self
        else:
            if state["stage"] is OptState.READY:  # checked, not unscaled: the kernel divides by the scale itself
                state["found_inf_per_device"] = self._check(optimizer, torch.ones_like(scale), allow_fp16=True)
            flags = [flag.to(scale.device, non_blocking=True) for flag in state["found_inf_per_device"].values()]
            unscaled = state["stage"] is OptState.UNSCALED
            optimizer.grad_scale = (  # type: ignore[attr-defined]
                getattr(optimizer, "grad_scale", None) if unscaled else scale * getattr(optimizer, "grad_scale", 1)
            )
            optimizer.found_inf = sum(flags)  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:  # a step that raised too (torch's leaves them: a retry would divide by the scale twice)
            if not handed:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
        state["stage"] = OptState.STEPPED
        # the fused kernel decided on the device: its flags are read only if someone asks
        outcome = StepOutcome(flags=list(state["found_inf_per_device"].values()))
        if len(optimizer.state) > created_from and outcome.read():
            # a skipped fused step still creates state (fused SGD's momentum uninitialised): take it back out
            for param in list(optimizer.state)[created_from:]:
                del optimizer.state[param]
        self._stepped(optimizer, outcome)
        return retval

    def overflowed(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Whether ``optimizer``'s gradients, unscaled in this update, hold inf/nan: its step will be skipped.

        Known where it costs no host sync of its own: a plain optimizer's flag is the one its :meth:`step` reads (read
        here once, kept for the step). None for a fused optimizer (it decides on the device: no host read a step), and
        for an optimizer not unscaled in this update.
        """
        if not self._enabled:
            return None
        states = self._per_optimizer_states
        if id(optimizer) not in states:  # a wrapper (manual optimization's LightningOptimizer): the optimizer inside
            optimizer = resolve_optimizer(optimizer)
        state = states.get(id(optimizer))
        if state is None or state["stage"] is not OptState.UNSCALED or not state["found_inf_per_device"]:
            return None
        if steps_on_device(optimizer):  # fused: it decides on the device, no host read a step
            return None
        return self._overflowed(state)

    @staticmethod
    def _overflowed(state: dict[str, Any]) -> bool:
        """The overflow flags of one optimizer's check, read on the host once (the read kept in its state)."""
        known = state.get("overflowed")
        if known is None:
            known = False
            for flag in state["found_inf_per_device"].values():
                known = known or bool(flag.item())
            state["overflowed"] = known
        return known

    def _stepped(self, optimizer: torch.optim.Optimizer, outcome: StepOutcome) -> None:
        """Keep ``optimizer``'s step outcome in the open update (a step after an update closed opens the next)."""
        if self._update.closed:
            self._update = UpdateRecord()
        self._update.outcomes[id(optimizer)] = outcome

    #: a scaler whose scale is placed at the first check, when no :meth:`scale` came first (the checker's)
    _places_scale = False

    def _place_scale(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the scale on ``optimizer``'s parameters' device (the checker's, when no :meth:`scale` came first)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._lazy_init_scale_growth_tracker(params[0].device if params else torch.device(self._device))

    def has_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` stepped (or skipped) in this cycle, i.e. since the last :meth:`update`."""
        key = id(resolve_optimizer(optimizer))
        if not self._enabled or key not in self._per_optimizer_states:
            return False
        return self._per_optimizer_states[key]["stage"] is OptState.STEPPED

    def any_step_skipped(self) -> bool:
        """Deprecated (0.2): whether any optimizer's last step was skipped (reads a fused step's device flag)."""
        deprecated(
            "DynamicLossScaler.any_step_skipped()",
            "`any_skipped(scaler.outcomes(), sync=True)` (or the plugin's `optimizer_step_was_skipped`)",
        )
        return bool(any_skipped(self.outcomes(), sync=True))

    def is_unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`unscale_` already ran for ``optimizer`` in this cycle."""
        key = id(resolve_optimizer(optimizer))
        if not self._enabled or key not in self._per_optimizer_states:
            return False
        return self._per_optimizer_states[key]["stage"] is OptState.UNSCALED

    def note_loss(self, loss: Tensor) -> None:
        """Keep whether ``loss`` (before scaling) holds inf/nan, on the device, for :attr:`backoff_on` ``"backward"``.

        One device op a backward, no host read; every micro-batch of an update counts.
        """
        bad = torch.isfinite(loss.detach()).logical_not().any()
        self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad

    def reset_cycle(self, optimizers: Iterable[torch.optim.Optimizer] | None = None) -> None:
        """Forget the unscale/step state of ``optimizers`` (default: all) in the open cycle; the scale stays.

        For recovery after an exception between :meth:`unscale_` and :meth:`update`, or gradients unscaled and then
        added to by another backward: the next :meth:`step` unscales again, and a forgotten optimizer's overflow no
        longer counts in :meth:`update`.
        """
        if optimizers is None:
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            self._loss_nonfinite = None
        else:
            for optimizer in optimizers:
                key = id(resolve_optimizer(optimizer))
                self._per_optimizer_states.pop(key, None)
                self._update.outcomes.pop(key, None)

    def step_was_skipped(self, optimizer: torch.optim.Optimizer, *, sync: bool = True) -> bool | None:
        """Whether the last step of ``optimizer`` was skipped (``None`` if it has not stepped).

        Free for non-fused optimizers (torch already read the flag). For fused optimizers the flag lives on the
        device: ``sync=True`` reads it (one host sync), ``sync=False`` returns ``None``.
        """
        return self._update.skipped_by(optimizer, sync)

    def outcomes(self) -> list[StepOutcome]:
        """The outcome of each optimizer's last step since :meth:`forget_skips` (read them with :func:`any_skipped`)."""
        return list(self._update.outcomes.values())

    def forget_skips(self) -> None:
        """Forget the last steps' outcomes (a new update begins)."""
        self._update = UpdateRecord()

    def found_inf(self) -> Tensor:
        """The combined overflow flag of this cycle so far (a device tensor, > 0 on overflow), as `update` sees it.

        One flag on the scale's device (the usual case) is returned as it is: no device op.
        """
        scale, _ = self._check_scale_growth_tracker("found_inf")
        flags = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        return _combined(flags, scale.device)

    # ------------------------------------------------------------------ the rule
    @property
    def _floor(self) -> float:
        return scale_floor(self._min_scale)  # min_scale=0 still never reaches 0 (whose inverse is inf)

    def known_outcome(self) -> bool | None:
        """Whether this cycle overflowed, as the host already knows it (free: no host sync).

        ``True``/``False``, or ``None`` when a fused optimizer decided on the device or an optimizer was checked
        without stepping.
        """
        return self._update.decide(self._per_optimizer_states)[0]

    @property
    def scale_kept(self) -> bool:
        """Whether the last update is known on the host to have left the scale unchanged (no sync)."""
        return self._host.kept

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """End the update: apply the bounded hysteresis rule once (on the device, no host sync).

        What the host already knows costs nothing: a skip torch read, a clean update whose growth tracker does not
        reach ``growth_interval`` (one device op then). What the update did is kept for :meth:`last_update`.
        ``new_scale``: set the scale instead (as torch's ``update``), brought inside the bounds; the update's outcome
        is recorded all the same (a subclass may call ``super().update(new_scale)``).
        """
        if not self._enabled:
            return
        if new_scale is not None:
            check_new_scale(f"{type(self).__name__}.update", new_scale)
        live, _ = self._check_scale_growth_tracker("update")
        host, record = self._host, self._update
        if record.closed:  # an update with no step since the last (a scale set between cycles): a record of its own
            record = self._update = UpdateRecord()
        kept = host.kept and new_scale is None
        scale = None if kept else live.clone()  # as it was: the rule changes it in place
        states = self._per_optimizer_states
        overflowed, skipped = record.decide(states)  # the update's one decision
        if not states and new_scale is not None:
            overflowed = skipped = False  # a scale set between cycles
        flag: Tensor | float = self.found_inf() if overflowed is None else float(overflowed)
        before = (float(live.item()) if self._moves else 1.0) if skipped is True else None  # read on skips only
        unstepped = () if overflowed is not None else tuple(k for k in states if k not in record.outcomes)
        if new_scale is None:
            self._apply(flag if isinstance(flag, Tensor) else None, overflowed)
        else:  # the caller's scale, inside the bounds at once (the growth tracker as it was, as in torch)
            host.kept = False
            if isinstance(new_scale, Tensor):
                live.copy_(new_scale.detach().reshape(()))
            else:
                live.fill_(float(new_scale))
            live.clamp_(min=self._floor, max=self._max_scale)
            self.reset_cycle()
        record.close(skipped, flag, scale, kept, before, unstepped)
        self._last = record

    def last_update(self) -> UpdateRecord | None:
        """What the last :meth:`update` did (None before the first)."""
        return self._last

    def _apply(self, found_inf: Tensor | None, overflowed: bool | None) -> None:
        """The rule, given the update's combined flag (when read already) and its outcome as the host knows it."""
        host = self._host
        host.kept = False
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        if overflowed is False and host.growth is None:
            host.growth = int(growth_tracker.item())  # the mirror was lost to a device-decided cycle: read it once
        exact = self._hysteresis == 1  # torch's own kernel then
        if overflowed is False and host.growth is not None and not grows(host.growth, self._growth_interval, exact):
            growth_tracker.add_(1)
            host.growth += 1
            host.kept = True
            self.reset_cycle()
            return
        host.growth = None if overflowed is None else 0  # a skip or a growth resets the mirror; the device's loses it
        found_inf = self.found_inf() if found_inf is None else found_inf
        loss_born = self._loss_born()
        if loss_born is not None:  # backoff_on="backward": a skip the loss already held is left out of the rule
            loss_born = loss_born & (found_inf > 0)  # an applied update is a clean one, whatever its loss
            kept = [scale.clone(), growth_tracker.clone()]
            if self._hysteresis_tracker is not None:
                kept.append(self._hysteresis_tracker.clone())
            found_inf = found_inf * loss_born.logical_not()
            host.growth = None  # the device decides whether the tracker moved: read again when needed
        if self._hysteresis == 1:
            # torch's own fused kernel, then the bounds: bit-identical to GradScaler inside float32's normal range
            torch._amp_update_scale_(
                scale, growth_tracker, found_inf, self._growth_factor, self._backoff_factor, self._growth_interval
            )
            scale.clamp_(min=self._floor, max=self._max_scale)
        else:
            self._update_with_hysteresis(scale, growth_tracker, found_inf)
        if loss_born is not None:  # as it was: neither a backoff nor a clean step
            scale.copy_(torch.where(loss_born, kept[0], scale))
            growth_tracker.copy_(torch.where(loss_born, kept[1], growth_tracker))
            if self._hysteresis_tracker is not None:
                self._hysteresis_tracker.copy_(torch.where(loss_born, kept[2], self._hysteresis_tracker))
        self.reset_cycle()

    def _loss_born(self) -> Tensor | None:
        """Whether this cycle's loss already held inf/nan (a device bool), where ``backoff_on="backward"``; else None.

        Reduced over the ranks (any rank's): every rank then applies the same rule.
        """
        flag = self._loss_nonfinite
        if self.backoff_on != "backward" or flag is None:
            return None
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = flag.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            flag = flag.bool()
        return flag

    def _update_with_hysteresis(self, scale: Tensor, growth_tracker: Tensor, found_inf: Tensor) -> None:
        assert self._hysteresis_tracker is not None
        hysteresis = self._hysteresis_tracker
        found = found_inf > 0
        succeeded = growth_tracker + 1
        grow = found.logical_not() & grows(growth_tracker, self._growth_interval, exact=False)
        growth_tracker.copy_(torch.where(found | grow, 0, succeeded))
        hysteresis.copy_(
            torch.where(found, (hysteresis - 1).clamp_min(0), torch.where(grow, self._hysteresis, hysteresis))
        )
        backoff = found & (hysteresis <= 0)
        grown = _times(scale, self._growth_factor)
        grown = torch.where(grown.isfinite(), grown, scale).clamp_max(self._max_scale)
        shrunk = _times(scale, self._backoff_factor).clamp_min(self._floor)
        scale.copy_(torch.where(backoff, shrunk, torch.where(grow, grown, scale)))

    # ------------------------------------------------------------------ state
    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    def state_dict(self) -> dict[str, Any]:
        """Torch's scaler state (a plain ``GradScaler`` loads it) plus the bounds and the hysteresis tracker."""
        state = super().state_dict()
        if self._enabled:
            state.update({knob.name: getattr(self, knob.attribute) for knob in KNOBS if not knob.torch})
            state["_hysteresis_tracker"] = self._get_hysteresis_tracker()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or a plain ``GradScaler`` state (our bounds are then kept).

        Every value is checked by the constructor's rules; an invalid one raises ``ValueError``/``TypeError`` naming
        the checkpoint key and the value. Its scale and trackers replace this scaler's. Its knobs do too, as in
        torch, except, with :attr:`keep_given` (a plugin's scaler), those given to the constructor: a setting passed
        on resume is meant, and kept. Each knob that changes, or is kept against the checkpoint's, is logged (logger
        ``lightning_amp_plus``, rank zero).
        A scale outside ``[min_scale, max_scale]`` is brought inside, and logged.
        """
        if not self._enabled:
            return
        where = f"{type(self).__name__}.load_state_dict"
        current = self._knobs()
        given = frozenset(k for k in self._given if k in current) if self.keep_given else frozenset()
        read = read_checkpoint(where, state_dict, current, given)
        if read.changes:
            say(f"`{where}`: the checkpoint's values replace this scaler's: " + "; ".join(read.changes) + ".")
        torch_knobs = {knob.name: read.knobs[knob.name] for knob in KNOBS if knob.torch and knob.name in read.knobs}
        super().load_state_dict({**state_dict, **torch_knobs, "scale": read.scale})
        self._host = HostMirror(read.growth_tracker)
        self._update = UpdateRecord()
        self._set_knobs({name: read.knobs[name] for name in ("min_scale", "max_scale", "hysteresis")})
        self._init_hysteresis_tracker = read.hysteresis_tracker
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    def __repr__(self) -> str:
        """The class and what differs from the defaults, with the live knobs (after a checkpoint or a setter)."""
        if not self._enabled:
            return f"{type(self).__name__}(enabled=False)"
        defaults = {name: p.default for name, p in inspect.signature(DynamicLossScaler.__init__).parameters.items()}
        live = {"device": self._device, "init_scale": self._constructed["init_scale"], **self._knobs()}
        shown = {k: v for k, v in self._given.items() if k not in live}  # e.g. process_group, sharded
        shown.update({k: v for k, v in live.items() if k in self._given or v != defaults.get(k)})
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def knobs(self) -> dict[str, Any]:
        """The settings in force, by name.

        ``init_scale`` (where this run's scale started: the checkpoint's on a resume), ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``min_scale``, ``max_scale``, ``hysteresis``.
        """
        return {"init_scale": float(self._init_scale), **self._knobs()}

    def _knobs(self) -> dict[str, Any]:
        """Every knob in force but the initial scale."""
        return {knob.name: getattr(self, knob.attribute) for knob in KNOBS if knob.name != "init_scale"}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_hysteresis_tracker"] = None
            state["_host"] = HostMirror(state["_init_growth_tracker"])
            state["_update"] = UpdateRecord()
        return state


def _combined(flags: list[Tensor], device: torch.device) -> Tensor:
    """The overflow flags summed on ``device`` (one flag, already there: itself, no device op)."""
    if len(flags) == 1 and flags[0].device == device:
        return flags[0]
    return torch.stack([f.to(device, non_blocking=True) for f in flags]).sum()


def _times(scale: Tensor, factor: float) -> Tensor:
    """``scale * factor`` rounded once to float32, as torch's update kernel computes it (in double)."""
    if scale.device.type == "mps":  # no float64 there
        return scale * factor
    return (scale.double() * factor).float()


class ShardedDynamicLossScaler(DynamicLossScaler):
    """:class:`DynamicLossScaler` for sharded gradients (FSDP, FSDP2): the overflow flag is reduced across ranks.

    Each rank checks only its own gradient shards; the flag is all-reduced (one small collective on the device, as
    ``torch.distributed.fsdp.ShardedGradScaler`` does) wherever torch checks gradients, in :meth:`unscale_` and in
    the check a fused optimizer's :meth:`step` makes without one, so every rank makes the same skip decision and
    keeps the same scale, trackers and history. A rank whose shard is empty still takes part. The bounds and
    hysteresis rule are :class:`DynamicLossScaler`'s, unchanged.

    Args:
        device: as for :class:`DynamicLossScaler`.
        process_group: the group to reduce over (default: the whole world).
        **kwargs: the knobs of :class:`DynamicLossScaler`.
    """

    def __init__(self, device: str = "cuda", *args: Any, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(device, *args, **kwargs)
        if process_group is not None:
            self._given = {**self._given, "process_group": process_group}
        self.process_group = process_group
        self._reduce_over_ranks = True


class NonFiniteChecker(DynamicLossScaler):
    """bf16-mixed's skip decision: a :class:`DynamicLossScaler` whose scale is 1 and never moves.

    It finds inf/nan in the gradients exactly as the scaler does (torch's fused check, multiplying by exactly 1, so
    the gradients are unchanged), skips the step (fused optimizers on the device), and reports it through the same
    ``found_inf()``/``step_was_skipped()``; ``sharded=True`` reduces the flag across ranks as
    :class:`ShardedDynamicLossScaler` does. Since it never scales, a closure optimizer (``LBFGS``) can step through
    it: every evaluation of the closure is checked after it ran, and a step that met inf/nan is undone (parameters
    and optimizer state restored bit for bit).

    Args:
        sharded: reduce the overflow flag over ``process_group`` (FSDP: each rank holds a shard).
        process_group: the group to reduce over (default: the whole world).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> checker = NonFiniteChecker()
        >>> checker.scale(model(torch.ones(1, 2)).sum() * float("nan")).backward()
        >>> _ = checker.step(opt)
        >>> checker.step_was_skipped(opt), checker.get_scale()
        (True, 1.0)
    """

    def __init__(self, *, sharded: bool = False, process_group: Any = None) -> None:
        super().__init__("cpu", init_scale=1.0)  # `update` never moves the scale: no growth or backoff knob acts
        self._given = given_arguments(NonFiniteChecker.__init__, locals())
        self.process_group = process_group
        self._reduce_over_ranks = sharded

    __repr__ = KnobsRepr.__repr__  # its knobs are fixed: the constructor's arguments say everything
    _moves = False

    #: bf16 scales nothing: a scale of 1 on the parameters' device stands in for the one scale() would place, so a
    #: backward that never went through :meth:`scale` (``loss.backward()`` called directly) is checked too
    _places_scale = True

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        """``outputs`` unchanged (the scale is 1); the first call places the scale on the outputs' device."""
        if isinstance(outputs, Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs
        return super().scale(outputs)

    def _apply(self, found_inf: Tensor | None, overflowed: bool | None) -> None:
        """End the cycle: forget every optimizer's check (the scale stays 1)."""
        self._host.kept = True
        self.reset_cycle()

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """End the cycle (the scale stays 1, whatever ``new_scale`` says)."""
        super().update()

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step unless the gradients hold inf/nan; with ``closure=`` (LBFGS) check every evaluation, undo on inf/nan."""
        closure = kwargs.pop("closure", None)
        if closure is None and args and callable(args[0]):
            closure, args = args[0], args[1:]
        if closure is None:
            return super().step(optimizer, *args, **kwargs)
        optimizer = resolve_optimizer(optimizer)
        if self._scale is None:
            self._place_scale(optimizer)
        return self._step_with_closure(optimizer, closure, *args, **kwargs)

    def _step_with_closure(self, optimizer: torch.optim.Optimizer, closure: Any, *args: Any, **kwargs: Any) -> Any:
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scale = self._scale
        assert scale is not None
        # float32 whatever the default dtype: torch's check takes float32 flags and an inverse scale
        one = torch.ones((), dtype=torch.float32, device=scale.device)
        flags: list[Tensor] = []

        def checked() -> Any:
            loss = closure()
            with torch.no_grad():
                found = torch.zeros((), dtype=torch.float32, device=scale.device)
                flags.extend(self._unscale_grads_(optimizer, one, found, True).values())
                if isinstance(loss, Tensor):
                    flags.append(loss.detach().isfinite().logical_not().any().to(found))
            return loss

        with torch.no_grad():
            saved_params = {p: p.detach().clone() for p in params}
            saved_state = {p: copy.deepcopy(s) for p, s in optimizer.state.items()}
        retval = optimizer.step(checked, *args, **kwargs)
        if not flags:
            raise RuntimeError(f"`{type(optimizer).__name__}.step(closure)` did not evaluate the closure.")
        found = torch.stack([f.to(scale.device) for f in flags]).sum()
        skipped = bool(found.item())  # a closure optimizer reads its loss on the host anyway
        if skipped:
            with torch.no_grad():
                for param, saved in saved_params.items():
                    param.copy_(saved)
            optimizer.state.clear()
            optimizer.state.update(saved_state)
        state["found_inf_per_device"] = {found.device: found}
        state["stage"] = OptState.STEPPED
        self._stepped(optimizer, SKIPPED if skipped else APPLIED)
        return retval
