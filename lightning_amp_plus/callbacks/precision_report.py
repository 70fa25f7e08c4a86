"""PrecisionReport: per leaf module, the dtypes autocast really produced and its share of forward time."""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.utils import parametrize
from typing_extensions import override

from lightning_amp_plus._identity import clean_name, is_compiled_wrapper
from lightning_amp_plus._log import say
from lightning_amp_plus._repr import KnobsRepr, given_arguments
from lightning_amp_plus._scope import FitScope
from lightning_amp_plus._validation import check_bool, check_fraction, check_int
from lightning_amp_plus.forensics._safe import attempt, replaying, torch_own
from lightning_amp_plus.forensics._tree import map_tensors, tensors, torch_only
from lightning_amp_plus.islands import island_of

#: module types whose work is matmul/conv: they belong in fp16/bf16 under autocast
HEAVY_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.MultiheadAttention,
    nn.LSTM,
    nn.GRU,
    nn.RNN,
)


def _first_dtype(value: Any) -> Optional[torch.dtype]:
    with torch_only():
        return next((t.dtype for t in tensors(value) if t.is_floating_point()), None)


def _copied(value: Any) -> Any:
    """``value`` with every tensor copied (``requires_grad`` kept): what a call received, safe from in-place change."""
    return map_tensors(lambda t: t.detach().clone().requires_grad_(t.requires_grad), value)


#: timed runs of each variant when a flagged module's lowered speed is measured (the median is kept)
SPEED_RUNS = 5


def lowered_speedup(module: nn.Module, args: Any, kwargs: Any, device_type: str, dtype: torch.dtype) -> float:
    """How many times faster ``module`` runs these inputs lowered by autocast than in float32 (median of runs).

    Each variant is warmed up once, then timed :data:`SPEED_RUNS` times, alternating, without grad, the module left
    as it was found. Above 1: autocast would make it faster on this device; at or below 1 it would not (float16 on
    most CPUs).
    """
    cuda = device_type == "cuda"

    def low(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    def high(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.is_floating_point() else t

    # `forward` itself: the module's hooks (a user's too) are no part of what is timed
    def lowered() -> None:
        with torch.autocast(device_type, dtype=dtype):
            module.forward(*map_tensors(low, args), **map_tensors(low, kwargs))

    def full() -> None:
        with torch.autocast(device_type, enabled=False):
            module.forward(*map_tensors(high, args), **map_tensors(high, kwargs))

    from lightning_amp_plus.forensics.opt_in.sandbox import sandboxed  # a flagged module of torch's own: timed

    times: dict[Any, list[float]] = {lowered: [], full: []}
    with sandboxed([module], device_type), torch.no_grad(), torch_only():
        for run in range(SPEED_RUNS + 1):
            for variant in (lowered, full):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                variant()
                if cuda:
                    torch.cuda.synchronize()
                if run:  # the first run of each is a warm-up
                    times[variant].append(time.perf_counter() - start)
    median = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    return median[full] / median[lowered] if median[lowered] > 0 else 1.0


def _name(dtype: Optional[torch.dtype]) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


class PrecisionReport(KnobsRepr, Callback):
    """Record, for each leaf module, the dtypes it ran in and its share of forward time; flag fp32 heavy work.

    On the first training batch (and every ``every_n_batches`` batches when given) it hooks every leaf module (and
    heavy modules with parts of their own, ``MultiheadAttention``, a parametrized Linear, as one) for one forward
    pass and records a row: ``name``, ``type``, ``input_dtype``, ``output_dtype``, ``param_dtype``,
    ``time_ms``, ``time_share``, ``autocast`` (whether autocast was on when the module ran), ``island`` (the fp32
    island it runs in, ``None`` outside one), ``compiled`` (inside a ``torch.compile``d submodule), ``flagged`` and
    ``cause``. A module is flagged when it does matmul/conv work (see ``HEAVY_TYPES``) or takes at least
    ``flag_share`` of the forward time, yet produced float32 under mixed precision outside an fp32 island (an island
    is your choice); the cause names autocast disabled around it (``autocast(enabled=False)``), or an explicit cast /
    an op autocast keeps in fp32. Rows are in :attr:`rows` (the latest inspection); a table is printed on rank zero.
    Hooks are removed right after the inspected batch, so the other batches cost nothing.

    Works with any precision plugin (it only reads dtypes); islands are known with ``AmpPlusPrecision``.

    ``torch.compile``: hooks inside a compiled graph would change what it computes, so a compiled submodule is never
    hooked inside: it is one row, read from outside its graph (marked ``compiled``). ``replay_compiled=True`` runs
    its call again eagerly, sandboxed, to give its leaves' rows (that runs your module's code a second time). A
    LightningModule compiled as a whole (``trainer.fit(torch.compile(model))``) is not inspected; the report says so.

    Timing is wall clock on CPU and CUDA events on GPU. ``lowered_speedup`` times only modules whose forward is
    torch's own (``nn.Linear``, not a subclass with its own ``forward``).

    Args:
        every_n_batches: inspect again every this many batches (default: only the first).
        flag_share: time share from which an fp32 module is flagged whatever its type (default 0.25).
        print_table: print the table on rank zero (default True).
        replay_compiled: replay a compiled submodule's call eagerly for its leaves' rows (default False).

    Example:
        >>> from lightning_amp_plus import PrecisionReport
        >>> PrecisionReport(every_n_batches=100).rows
        []
    """

    def __init__(
        self,
        every_n_batches: Optional[int] = None,
        flag_share: float = 0.25,
        print_table: bool = True,
        replay_compiled: bool = False,
    ) -> None:
        self._given = given_arguments(PrecisionReport.__init__, locals())
        self._fit_scope = FitScope()
        owner = type(self).__name__
        if every_n_batches is not None:
            check_int(owner, "every_n_batches", every_n_batches, minimum=1)
        check_bool(owner, "print_table", print_table)
        self.every_n_batches = every_n_batches
        self.flag_share = check_fraction(owner, "flag_share", flag_share)
        self.print_table = print_table
        self.replay_compiled = check_bool(owner, "replay_compiled", replay_compiled)
        self.rows: list[dict[str, Any]] = []
        self.skipped_reason: Optional[str] = None
        self._handles: list[Any] = []
        self._stats: dict[str, dict[str, Any]] = {}
        self._order: list[str] = []
        self._batches = 0
        self._precision = ""
        self._islands: list[str] = []
        self._inspecting = False  # hooks (or a reason for none) in place for this batch
        self._device_type = "cpu"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # any precision plugin: the report reads dtypes; the islands are the ones our plugin installed
        plugin = trainer.strategy.precision_plugin
        self._precision = str(getattr(plugin, "precision", ""))
        self._plugin = plugin
        if stage == "fit" and self._fit_scope.starts_afresh(trainer):
            self._batches = 0  # a new Trainer's fit inspects its first batch again

    def _due(self) -> bool:
        if self._batches == 0:
            return True
        return self.every_n_batches is not None and self._batches % self.every_n_batches == 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._due():
            self._install(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._inspecting:
            self._inspecting = False
            self._remove()
            self.rows = self._build_rows()
            if self.print_table and trainer.is_global_zero:
                say(self.format_table())
        self._batches += 1

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()  # Lightning skips `teardown` after an exception: no hook stays on the user's model

    # ------------------------------------------------------------------ hooks
    def _install(self, pl_module: pl.LightningModule) -> None:
        self._stats = {}
        self._order = []
        self.skipped_reason = None
        self._inspecting = True
        self._islands = list(getattr(self._plugin, "fp32_module_names", []) or [])
        device_type = pl_module.device.type
        self._device_type = device_type
        if getattr(pl_module, "_compiler_ctx", None) is not None:
            self.skipped_reason = (
                "the LightningModule is compiled as a whole (`trainer.fit(torch.compile(model))`): hooks inside its"
                " graph would change what it computes, so nothing was inspected. HINT: compile submodules"
                " (`self.net = torch.compile(self.net)`); the report then inspects them by an eager replay."
            )
            return
        # what runs inside a compiled graph, by identity: an eager alias of a compiled module (`self.fast =
        # torch.compile(self.body)`) is inside it too, whatever name `named_modules()` gives it
        wrappers = [(n, m) for n, m in pl_module.named_modules(remove_duplicate=False) if n and is_compiled_wrapper(m)]
        compiled = {id(m) for _, w in wrappers for m in w._orig_mod.modules()}
        outer = {id(w) for _, w in wrappers if id(w) not in compiled}
        replayed: set[int] = set()
        for raw_name, module in wrappers:
            if id(module) in outer and id(module) not in replayed:
                replayed.add(id(module))
                if self.replay_compiled:
                    self._hook_replay(raw_name, module, device_type)
                else:  # one row, from outside its graph: what it took and gave
                    self._hook_leaf(clean_name(raw_name), module, device_type, compiled=False, handles=self._handles)
                    self._stats[clean_name(raw_name)]["compiled"] = True
        whole: set[int] = set()  # inside a module read as one row
        for raw_name, module in pl_module.named_modules():
            if not raw_name or is_compiled_wrapper(module) or id(module) in compiled or id(module) in whole:
                continue  # inside a compiled graph: one row, or inspected by the replay
            # a row: a leaf, or heavy work whose children are its own parts (`MultiheadAttention.out_proj`, a
            # parametrization computing a weight)
            if isinstance(module, HEAVY_TYPES) or parametrize.is_parametrized(module):
                whole.update(id(m) for m in module.modules() if m is not module)
            elif list(module.children()):
                continue
            self._hook_leaf(clean_name(raw_name), module, device_type, compiled=False, handles=self._handles)

    def _hook_leaf(self, name: str, module: nn.Module, device_type: str, *, compiled: bool, handles: list[Any]) -> None:
        use_events = device_type == "cuda"
        heavy = isinstance(module, HEAVY_TYPES)
        stats = self._stats.setdefault(name, {"module": module, "time": 0.0, "events": [], "compiled": compiled})

        def pre(mod: nn.Module, args: Any, kwargs: Any) -> None:
            if replaying() and not compiled:
                return  # an origin replay's calls are no part of the batch (a compiled module's replay is)
            if name not in self._order:
                self._order.append(name)
            stats["input"] = stats.get("input") or _first_dtype((args, kwargs))
            if heavy and "call" not in stats:  # kept by reference until the rows are built: its speed lowered
                stats["call"] = (args, kwargs)
            stats["autocast"] = torch.is_autocast_enabled(device_type)
            if use_events:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                stats["start"] = start
            else:
                stats["t0"] = time.perf_counter()

        def post(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if replaying() and not compiled:
                return
            if use_events:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                stats["events"].append((stats.pop("start"), end))
            else:
                stats["time"] += time.perf_counter() - stats.pop("t0")
            stats["output"] = _first_dtype(output)  # also: a call ended (a forward that raised has none)

        try:
            first = module.register_forward_pre_hook(pre, with_kwargs=True)
        except RuntimeError:  # a module that refuses hooks (a scripted one): it has no row
            self._stats.pop(name, None)
            return
        handles.extend((first, module.register_forward_hook(post, with_kwargs=True)))

    def _hook_replay(self, raw_name: str, wrapper: nn.Module, device_type: str) -> None:
        """A compiled submodule: after its compiled forward, replay the call eagerly with its leaves hooked."""
        inner: nn.Module = wrapper._orig_mod  # type: ignore[assignment]
        calls: list[tuple[Any, Any]] = []

        def pre(mod: nn.Module, args: Any, kwargs: Any) -> None:
            # copies: the compiled call may change its inputs in place; the replay must see them as they came
            calls.append((_copied((args, kwargs)), torch.is_grad_enabled()))

        def post(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            (call_args, call_kwargs), grad = calls.pop()
            if calls:  # a nested call of the same wrapper: the outermost one replays
                return
            from lightning_amp_plus.forensics.opt_in.sandbox import sandboxed  # replay_compiled=True, by name

            handles: list[Any] = []
            try:
                for name, module in inner.named_modules():
                    if not list(module.children()):  # a compiled wrapper has its module as a child
                        full = clean_name(f"{raw_name}.{name}" if name else raw_name)
                        self._hook_leaf(full, module, device_type, compiled=True, handles=handles)
                # eager, in the compiled call's autocast and grad mode (a forward may call autograd.grad), with every
                # nested compiled module eager too (no hook may end up inside a graph): the sandbox runs it on stand-ins
                with sandboxed([inner], device_type), torch.set_grad_enabled(grad):
                    inner(*call_args, **call_kwargs)
            except Exception as error:  # the report never stops training
                self.skipped_reason = (
                    f"the eager replay of {clean_name(raw_name)} failed ({error!r}); its rows are missing"
                )
            finally:
                for handle in handles:
                    handle.remove()

        self._handles.append(wrapper.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(wrapper.register_forward_hook(post, with_kwargs=True))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ rows
    def _build_rows(self) -> list[dict[str, Any]]:
        if any(s["events"] for s in self._stats.values()):
            torch.cuda.synchronize()
            for s in self._stats.values():
                s["time"] = sum(a.elapsed_time(b) for a, b in s["events"]) / 1e3
        ran = [(n, self._stats[n]) for n in self._order if "output" in self._stats[n]]
        total = sum(s["time"] for _, s in ran) or 1.0
        mixed = self._precision.endswith("-mixed")
        rows = []
        for name, s in ran:
            module = s["module"]
            params = list(module.parameters(recurse=False))
            param_dtype = params[0].dtype if params else None
            share = s["time"] / total
            output = s.get("output")
            heavy = isinstance(module, HEAVY_TYPES)
            island = island_of(name, self._islands)
            ran_in_island = island is not None  # hooks run outside the island's wrapper: what ran inside is fp32
            # an island is your choice, in float32 by design: no heavy work "left" there
            flagged = mixed and output == torch.float32 and island is None and (heavy or share >= self.flag_share)
            cause = None
            if flagged:
                if not s.get("autocast"):
                    cause = "autocast disabled around it (an `autocast(enabled=False)` block)"
                elif s.get("input") == torch.float32 and not heavy:
                    cause = "an op autocast keeps in float32 (its fp32 list), or fp32 inputs"
                else:
                    cause = "an explicit cast to float32 (`.float()`), or an op autocast keeps in float32"
            speedup = None
            if flagged and heavy and "call" in s and torch_own(module):  # never your code again
                low = torch.bfloat16 if self._precision.startswith("bf16") else torch.float16
                args, kwargs = s["call"]
                speedup, _ = attempt(lowered_speedup, module, args, kwargs, self._device_type, low)
            s.pop("call", None)  # the inputs are released
            rows.append(
                {
                    "name": name,
                    "type": type(module).__name__,
                    "input_dtype": "float32" if ran_in_island and s.get("input") is not None else _name(s.get("input")),
                    "output_dtype": _name(output),
                    "param_dtype": _name(param_dtype),
                    "time_ms": s["time"] * 1e3,
                    "time_share": share,
                    "autocast": bool(s.get("autocast")) and not ran_in_island,
                    "island": island,
                    "compiled": s["compiled"],
                    "flagged": flagged,
                    "cause": cause,
                    "lowered_speedup": speedup,
                }
            )
        return rows

    def format_table(self) -> str:
        """The latest rows as a text table."""
        title = "PrecisionReport (first inspected batch)" if self._batches == 0 else "PrecisionReport"
        if self.skipped_reason:
            return f"{title}: {self.skipped_reason}"
        header = ("module", "type", "in", "out", "param", "time ms", "share", "island", "flag")
        lines = [
            (
                r["name"] + (" [compiled]" if r["compiled"] else ""),
                r["type"],
                r["input_dtype"],
                r["output_dtype"],
                r["param_dtype"],
                f"{r['time_ms']:.3f}",
                f"{100 * r['time_share']:.1f}%",
                "fp32" if r["island"] is not None else "",
                r["cause"] or "",
            )
            for r in self.rows
        ]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [title, fmt.format(*header).rstrip()]
        out.extend(fmt.format(*line).rstrip() for line in lines)
        islands = sorted({r["island"] for r in self.rows if r["island"] is not None})
        if islands:
            out.append(f"fp32 islands: {', '.join(islands)}")
        if any(r["compiled"] for r in self.rows):
            out.append(
                "[compiled]: inside a torch.compile'd submodule: dtypes and times from an eager replay of the inspected"
                " call (no grad, random state and buffers restored); the compiled kernels' own times are not measured."
                if self.replay_compiled
                else "[compiled]: a torch.compile'd submodule, read from outside its graph as one row"
                " (`PrecisionReport(replay_compiled=True)` replays it eagerly for its leaves)."
            )
        flagged = [r for r in self.rows if r["flagged"]]
        if flagged:
            out.append(
                f"{len(flagged)} module(s) do heavy work in float32 under mixed precision: "
                + ", ".join(r["name"] for r in flagged)
            )
        return "\n".join(out)
