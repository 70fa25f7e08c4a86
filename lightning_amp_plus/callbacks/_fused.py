"""Which optimizers could run fused, and what fusing them is measured to save on this device (``fused_optimizer``).

The advice names the cause that was measured: one optimizer step timed as the user configured it and with
``fused=True``, on copies of its parameters and gradients (the run's optimizer and state are never touched), against
the run's own step time.
"""

from __future__ import annotations

import ast
import inspect
import io
import keyword
import textwrap
import time
import tokenize
from typing import Any, Optional

import torch

from lightning_amp_plus._identity import resolve_optimizer
from lightning_amp_plus._repr import same_value
from lightning_amp_plus.forensics._safe import attempt
from lightning_amp_plus.scaler import steps_on_device

#: torch optimizers with a fused implementation, and the device types it runs on (None: torch's fused list)
FUSED: dict[str, Optional[tuple[str, ...]]] = {"SGD": None, "Adam": None, "AdamW": None, "Adagrad": ("cpu",)}
#: timed steps of each variant, alternating, after one warm-up each (medians and the gain's quartile are kept)
TIMED_STEPS = 9
#: the settings a fix drops to write `fused=True` (torch refuses `fused` and `foreach` together)
_MADE_WAY = ("fused", "foreach")
#: parameter elements timed at most (a larger model is timed on its first parameters, scaled to the whole)
TIMED_ELEMENTS = 2**24


def candidates(
    optimizers: list[Any], module: Optional[torch.nn.Module] = None
) -> list[tuple[torch.optim.Optimizer, dict[str, Any]]]:
    """The torch optimizers that have a fused kernel for their device and float parameters, and run without it.

    Each with its entry: ``name``, ``device``, ``params`` (what it optimizes, as ``module``'s code names it) and
    ``fused_call`` (the user's call with ``fused=True``).
    """
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        supported = tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - torch versions without the helper
        supported = ("cuda",)
    found = []
    for optimizer in optimizers:
        real = resolve_optimizer(optimizer)
        name = type(real).__name__
        if type(real).__module__.split(".")[:2] != ["torch", "optim"] or name not in FUSED or steps_on_device(real):
            continue
        params = [p for g in real.param_groups for p in g["params"]]
        devices = {p.device.type for p in params}  # fused kernels group by device: each must have one
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            continue  # fused kernels refuse sparse gradients (an `Embedding(sparse=True)`)
        if devices <= set(FUSED[name] or supported) and all(p.is_floating_point() for p in params):
            given = parameters_named(real, module)
            entry = {"name": name, "device": ", ".join(sorted(devices)), "params": given}
            call = own_call(module, real, given) or fused_call(real, given)
            found.append((real, {**entry, "fused_call": call}))
    return found


def parameters_named(optimizer: torch.optim.Optimizer, module: Optional[torch.nn.Module]) -> Optional[str]:
    """``optimizer``'s parameters as the LightningModule's code names them: ``self.generator.parameters()``.

    The module (or submodule) whose parameters are exactly its one group's; None when no module's are (several
    groups, a hand-picked list): a fix cannot name them.
    """
    if module is None or len(optimizer.param_groups) != 1:
        return None
    mine = {id(p) for p in optimizer.param_groups[0]["params"]}
    for name, sub in module.named_modules():
        if {id(p) for p in sub.parameters()} == mine:
            return f"{attribute_path(module, name)}.parameters()"
    return None


def attribute_path(module: torch.nn.Module, name: str) -> str:
    """Python that reaches ``module``'s submodule ``name`` from ``self``: ``self.net[2]``, ``self.heads["a-b"]``.

    Example:
        >>> from torch import nn
        >>> m = nn.Module()
        >>> m.net, m.heads = nn.Sequential(nn.ReLU(), nn.Linear(1, 1)), nn.ModuleDict({"a-b": nn.ReLU()})
        >>> attribute_path(m, "net.1"), attribute_path(m, "heads.a-b"), attribute_path(m, "")
        ('self.net[1]', 'self.heads["a-b"]', 'self')
    """
    path, current = "self", module
    for part in name.split(".") if name else []:
        if isinstance(current, (torch.nn.Sequential, torch.nn.ModuleList)) and part.isdigit():
            path += f"[{part}]"
        elif isinstance(current, torch.nn.ModuleDict):
            path += f"[{part!r}]".replace("'", '"')
        elif part.isidentifier() and not keyword.iskeyword(part):
            path += f".{part}"
        else:
            path = f"getattr({path}, {part!r})".replace("'", '"')
        current = getattr(current, part)
    return path


def fused_call(optimizer: torch.optim.Optimizer, params: Optional[str] = None) -> str:
    """The user's optimizer call with ``fused=True``: every setting that differs from the class's default kept.

    ``params``: what it optimizes (:func:`parameters_named`); None: ``params``, which the user's call names.
    """
    cls = type(optimizer)
    defaults = {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if p.default is not p.empty}
    kept = [
        f"{name}={value!r}"
        for name, value in optimizer.defaults.items()
        if name not in _MADE_WAY and name in defaults and not same_value(value, defaults[name])
    ]
    note = "" if params is not None else "  # params: the parameters (or groups) your call passes"
    return f"torch.optim.{cls.__name__}({', '.join([params or 'params', *kept, 'fused=True'])}){note}"


def own_call(
    module: Optional[torch.nn.Module], optimizer: torch.optim.Optimizer, params: Optional[str]
) -> Optional[str]:
    """The user's own call of ``optimizer``'s class in ``configure_optimizers``, as written, with ``fused=True``.

    ``lr=self.lr`` stays ``lr=self.lr``; comments inside it go, and its ``fused=``/``foreach=`` make way for
    ``fused=True``. The call is the one without ``fused=True`` in that method's source that can have built
    ``optimizer``: its first argument ``params`` where that is known, its literal settings ``optimizer``'s (not a
    branch that did not run, nor another optimizer's). None when its source cannot be read, no one call is it, or
    it passes ``**settings`` (which may hold ``fused``): then :func:`fused_call` writes the settings' values.
    """
    method = getattr(type(module), "configure_optimizers", None) if module is not None else None
    if method is None:
        return None
    try:
        source = textwrap.dedent(inspect.getsource(method))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    name = type(optimizer).__name__

    def text(node: ast.AST) -> str:
        lines = (ast.get_source_segment(source, node) or "").splitlines()
        try:  # a comment inside a call written over several lines would swallow the rest once they are joined
            for token in tokenize.generate_tokens(io.StringIO("\n".join(lines)).readline):
                if token.type == tokenize.COMMENT:  # it runs to the end of its line
                    row, column = token.start
                    lines[row - 1] = lines[row - 1][:column]
                elif token.start[0] != token.end[0] and token.type not in (tokenize.NL, tokenize.NEWLINE):
                    return ""  # a string over several lines: joining them would change it
        except (tokenize.TokenError, SyntaxError):
            return ""
        return " ".join(line.strip() for line in lines if line.strip())  # what each line holds, as written

    def literal(node: ast.AST) -> Any:
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return _UNREAD

    signature = inspect.signature(type(optimizer).__init__).parameters
    order = [n for n in signature if n != "self"]

    def built_it(call: ast.Call) -> bool:
        if any(k.arg == "fused" and literal(k.value) not in (False, None) for k in call.keywords):
            return False  # already fused: not the call the advice is about
        if params is not None and not (call.args and text(call.args[0]) == params):
            return False
        written = {**dict(zip(order, call.args, strict=False)), **{k.arg: k.value for k in call.keywords if k.arg}}
        for setting, value in optimizer.defaults.items():
            if setting in _MADE_WAY or setting not in signature:
                continue
            node = written.get(setting)
            given = signature[setting].default if node is None else literal(node)
            if given is not inspect.Parameter.empty and given is not _UNREAD and not _same_setting(given, value):
                return False  # a setting it writes, or leaves at the class's default, that the optimizer has not
        return True

    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)) == name
        and built_it(node)
    ]
    if len(calls) != 1 or any(k.arg is None for k in calls[0].keywords):
        return None
    call = calls[0]
    parts = [text(a) for a in call.args]
    parts += [f"{k.arg}={text(k.value)}" for k in call.keywords if k.arg not in _MADE_WAY]
    if not all(parts):
        return None
    return f"{text(call.func)}({', '.join([*parts, 'fused=True'])})"


#: a setting whose value is not a literal (``self.lr``): not compared
_UNREAD = object()


def _same_setting(a: Any, b: Any) -> bool:
    """Whether an optimizer setting as written is the one it holds: numbers by value, a list as the tuple torch keeps.

    Example:
        >>> _same_setting([0.9, 0.95], (0.9, 0.95)), _same_setting(0, 0.0), _same_setting(False, 0)
        (True, True, False)
    """
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b, strict=True))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    return same_value(a, b)


def step_times(optimizer: torch.optim.Optimizer) -> Optional[dict[str, float]]:
    """One step of ``optimizer`` as configured and with ``fused=True``, timed on copies, with the noise (or None).

    Each variant steps copies of the parameters with gradients of their size, warmed up once, then both are timed
    :data:`TIMED_STEPS` times, alternating: ``step_ms`` and ``fused_step_ms`` are the medians, ``gain_ms`` the median
    of the pairs' differences and ``gain_low_ms`` their lower quartile (the fused step saved at least that in three
    pairs of four: a gain beyond the timing's noise only when it is above 0), ``pairs`` how many. At most
    :data:`TIMED_ELEMENTS` parameter elements are copied: a larger model's figures are scaled to its size.
    """
    groups, total, timed = [], 0, 0
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        total += sum(p.numel() for p in params)
        chosen = []
        for p in params:
            if timed + p.numel() <= TIMED_ELEMENTS or not timed:
                chosen.append(p)
                timed += p.numel()
        if chosen:
            groups.append(({k: v for k, v in group.items() if k != "params"}, chosen))
    if not timed:
        return None
    pairs, _ = attempt(_timed, type(optimizer), groups)
    if not pairs:
        return None
    return summary([(plain * total / timed, fused * total / timed) for plain, fused in pairs])


def summary(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """Alternating ``(step, fused step)`` timings read as :func:`step_times` gives them.

    Example:
        >>> summary([(2.0, 1.0), (2.2, 1.1), (1.9, 1.2), (2.1, 2.3)])
        {'step_ms': 2.1, 'fused_step_ms': 1.2, 'gain_ms': 1.0, 'gain_low_ms': 0.7, 'pairs': 4}
    """

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    gains = sorted(plain - fused for plain, fused in pairs)
    return {
        "step_ms": median([p for p, _ in pairs]),
        "fused_step_ms": median([f for _, f in pairs]),
        "gain_ms": round(median(gains), 6),
        "gain_low_ms": round(gains[len(gains) // 4], 6),
        "pairs": len(pairs),
    }


def _timed(cls: type, groups: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> list[tuple[float, float]]:
    def build(fused: bool) -> torch.optim.Optimizer:
        built = []
        for options, params in groups:
            copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for copy in copies:
                copy.grad = torch.full_like(copy, 1e-3)  # no random stream of the run is drawn from
            extra = {"fused": True, "foreach": None} if fused else {}
            built.append({**options, **extra, "params": copies})
        return cls(built)

    variants = {False: build(False), True: build(True)}
    cuda = any(p.is_cuda for _, ps in groups for p in ps)
    pairs: list[tuple[float, float]] = []
    for run in range(TIMED_STEPS + 1):
        spent = []
        for optimizer in variants.values():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            spent.append(1e3 * (time.perf_counter() - start))
        if run:  # the first of each is a warm-up
            pairs.append((spent[0], spent[1]))
    return pairs
