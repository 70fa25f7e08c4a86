"""fp32 islands: run chosen modules with autocast disabled and float32 inputs, without touching model code.

Torch only. :class:`Fp32Islands` resolves the user's entries (module classes, import paths of classes, qualified
names or glob patterns as in ``named_modules()``), then installs a forward wrapper on each matched module instance
and removes it again; parameters, buffers and ``state_dict()`` keys are never changed.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import functools
import importlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_amp_plus._identity import clean_name, is_compiled_wrapper
from lightning_amp_plus.forensics._tree import map_tensors

Fp32Entry = Union[str, type]


def _resolve_class(entry: str) -> type | None:
    """``"torch.nn.LayerNorm"`` -> the class; None when ``entry`` names no importable module class (a name pattern)."""
    module = _module_of(entry)
    obj = getattr(module, entry.rpartition(".")[2], None) if module is not None else None
    return obj if isinstance(obj, type) and issubclass(obj, nn.Module) else None


def _module_of(entry: str) -> Any:
    """The Python module ``entry``'s part before its last dot imports (None: none does, or ``entry`` is a pattern).

    Only a module imported already is read (``torch.nn`` for ``torch.nn.LayerNorm``; your model's own module, once
    imported): nothing is imported here, so a module name (``towers.1.0``, ``enc.Proj``) never runs a script or
    package of the same name.
    """
    if "." not in entry or any(ch in entry for ch in "*?[]"):
        return None
    path = entry.rpartition(".")[0]
    if not all(part.isidentifier() for part in entry.split(".")) or path not in sys.modules:
        return None
    try:
        return importlib.import_module(path)
    except (ImportError, ValueError):
        return None


def _failed_import(entry: str) -> str:
    """For an entry that matched no module name: the class path it may have meant, when its module imports."""
    module = _module_of(entry)
    if module is None:
        return ""
    module_name, _, attr = entry.rpartition(".")
    classes = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, nn.Module)]
    close = difflib.get_close_matches(attr, classes, n=3)
    meant = f" Did you mean {', '.join(f'{module_name}.{c}' for c in close)}?" if close else ""
    return f" HINT: read as a module name, since `{module_name}` has no module class `{attr}`.{meant}"


def _class_path(cls: type) -> str:
    """A module class's import path, ``torch.nn.LayerNorm`` where ``torch.nn`` exports it."""
    return (
        f"torch.nn.{cls.__name__}" if getattr(nn, cls.__name__, None) is cls else f"{cls.__module__}.{cls.__qualname__}"
    )


def check_entries(owner: str, entries: Any) -> list[Fp32Entry]:
    """Validate ``fp32_modules`` (a list of module classes or strings)."""
    if entries is None:
        return []
    if isinstance(entries, (str, type)) or not isinstance(entries, Iterable):
        raise TypeError(
            f"`{owner}(fp32_modules={entries!r})` is invalid: expected a list of module classes, import paths"
            " or module-name patterns, e.g. [torch.nn.LayerNorm, 'head', 'encoder.*.attn']."
        )
    out: list[Fp32Entry] = []
    for entry in entries:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            out.append(entry)
        elif isinstance(entry, str) and entry:
            out.append(_resolve_class(entry) or entry)
        else:
            raise TypeError(
                f"`{owner}(fp32_modules=[..., {entry!r}, ...])` is invalid: each entry must be an `nn.Module`"
                " subclass, an import path of one, or a module-name pattern."
            )
    return out


def _to_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Half floats to float32; float64, integers and bools as they came."""
    return tensor.float() if tensor.is_floating_point() and tensor.dtype != torch.float64 else tensor


def _cast_inputs(value: Any) -> Any:
    return map_tensors(_to_float32, value)


def fp32_forward(original: Any, device_type: str) -> Any:
    """``original`` (a module's forward) run with autocast disabled and its half-float inputs made float32."""

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            return original(*_cast_inputs(args), **_cast_inputs(kwargs))

    forward.fp32_island = True  # type: ignore[attr-defined]
    return forward


def island_of(name: str, islands: Iterable[str]) -> Optional[str]:
    """The island module ``name`` runs in: itself or its closest enclosing module in ``islands``; None outside.

    Example:
        >>> island_of("enc.1.attn", ["enc", "enc.1"]), island_of("enc.10", ["enc.1"])
        ('enc.1', None)
    """
    inside = [i for i in islands if name == i or name.startswith(i + ".")]
    return max(inside, key=len) if inside else None


def set_aside(modules: Iterable[nn.Module], device_type: str) -> list[tuple[nn.Module, Any]]:
    """Run each of ``modules`` in float32 (:func:`fp32_forward`); one already an island stays as it is.

    A forward set on the instance (a library's hook) is wrapped, not replaced. Returns what :func:`put_back` undoes.
    """
    installed = []
    for module in modules:
        previous = vars(module).get("forward")
        if not getattr(previous, "fp32_island", False):
            module.forward = fp32_forward(module.forward, device_type)  # type: ignore[method-assign]
            installed.append((module, previous))
    return installed


def put_back(installed: list[tuple[nn.Module, Any]]) -> None:
    """Each module's forward as :func:`set_aside` found it."""
    for module, previous in reversed(installed):
        if previous is None:
            vars(module).pop("forward", None)
        else:
            module.forward = previous  # type: ignore[method-assign]


@contextlib.contextmanager
def in_float32(modules: Iterable[nn.Module], device_type: str) -> Iterator[None]:
    """``modules`` run in float32 inside, as ``fp32_modules`` runs them."""
    installed = set_aside(modules, device_type)
    try:
        yield
    finally:
        put_back(installed)


def compiled_or_scripted(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` cannot take a float32 forward (a compiled or scripted module), or None."""
    from lightning_amp_plus.forensics._modules import How, how

    return {
        How.SCRIPTED: "it is scripted (torch.jit)",
        How.COMPILED: "it is compiled (torch.compile)",
        How.IN_PLACE: "it is compiled in place (module.compile())",
    }.get(how(module))


class Fp32Islands:
    """The modules of one model that run in float32 under autocast.

    Args:
        entries: module classes or qualified-name patterns (already checked by :func:`check_entries`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        >>> islands = Fp32Islands([nn.LayerNorm, "2"])
        >>> islands.install(model, "cpu")
        ['1', '2']
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     model(torch.randn(3, 4)).dtype
        torch.float32
        >>> islands.remove()
        >>> "forward" in vars(model[1])
        False
    """

    def __init__(self, entries: Sequence[Fp32Entry]) -> None:
        self.entries = list(entries)
        self.names: list[str] = []
        self._installed: list[tuple[nn.Module, Any]] = []

    def match(self, model: nn.Module) -> list[str]:
        """Names of the modules the entries select; raises ``ValueError`` for an entry that matches nothing."""
        # a compiled submodule (`torch.compile`) appears twice: its wrapper and `<name>._orig_mod`: keep the module
        # itself, and match names with or without the wrapper's `_orig_mod` segment
        named = [(n, m) for n, m in model.named_modules() if n and not is_compiled_wrapper(m)]
        selected: dict[str, None] = {}
        for entry in self.entries:
            if isinstance(entry, type):
                hits = [n for n, m in named if isinstance(m, entry)]
                what = f"class {entry.__module__}.{entry.__qualname__}"
            else:
                # names as the user wrote them; the raw name only for a pattern that spells `_orig_mod` itself (so
                # "net.*" selects what it selects without compile, never the compiled `net` as `net._orig_mod`)
                # a module's name as printed selects that module: `[0]` in a `ModuleDict` key is no pattern there
                raw = "_orig_mod" in entry
                shown = [(n, n if raw else clean_name(n)) for n, _ in named]
                hits = [n for n, as_shown in shown if as_shown == entry]
                hits = hits or [n for n, as_shown in shown if fnmatch.fnmatchcase(as_shown, entry)]
                what = f"pattern {entry!r}"
            if not hits:
                names = [n for n, _ in named]
                close = difflib.get_close_matches(str(entry), names, n=5, cutoff=0.3) or names[:5]
                classes = {
                    type(m) for _, m in named if isinstance(entry, str) and fnmatch.fnmatchcase(type(m).__name__, entry)
                }
                hint = (
                    f" HINT: {entry!r} is a class name: give the class or its import path, "
                    + ", ".join(sorted(f'"{_class_path(c)}"' for c in classes))
                    + ", to select every module of that class."
                    if classes
                    else _failed_import(entry)
                    if isinstance(entry, str)
                    else ""
                )
                raise ValueError(
                    f"`AmpPlusPrecision(fp32_modules=...)`: the {what} matches no module of"
                    f" {type(model).__name__}. Close module names: {', '.join(close) or '(none)'}.{hint}"
                )
            selected.update(dict.fromkeys(hits))
        return list(selected)

    def install(self, model: nn.Module, device_type: str) -> list[str]:
        """Wrap the selected modules' ``forward``; returns their names (without ``torch.compile``'s ``_orig_mod.``)."""
        self.remove()
        names = self.match(model)
        modules = dict(model.named_modules())
        self._installed = set_aside([modules[name] for name in names], device_type)
        # reported as the user wrote them (a compiled submodule's `_orig_mod.` dropped): the names every report uses
        self.names = list(dict.fromkeys(clean_name(name) for name in names))
        return list(self.names)

    def add(self, model: nn.Module, name: str, device_type: str) -> Optional[str]:
        """Run the module named ``name`` (as the watch names it) in float32 too; why it cannot be, or None.

        An island found by observation (``auto_islands``): one module, by its exact name. A compiled or scripted
        module cannot take a float32 forward.
        """
        module = next((m for n, m in model.named_modules() if n and clean_name(n) == name), None)
        if module is None:
            return "no module of the model has that name now"
        if getattr(vars(module).get("forward"), "fp32_island", False):
            return None  # this very module runs in float32 already
        why = compiled_or_scripted(module)
        if why is not None:
            return why
        try:
            self._installed += set_aside([module], device_type)
        except Exception as error:  # a module whose forward cannot be set: told, and the run goes on
            return f"its forward cannot be wrapped ({type(error).__name__}: {error})"[:200]
        self.names += [] if name in self.names else [name]
        return None

    def running(self, model: Optional[nn.Module]) -> list[str]:
        """The names whose module runs in float32 now.

        A module replaced under its name mid-fit (a new instance) does not, until it is made an island again.
        """
        if model is None or not self.names:
            return list(self.names)
        wrapped = {id(m) for m, _ in self._installed}
        now = {clean_name(n): m for n, m in model.named_modules() if n}
        return [name for name in self.names if name not in now or id(now[name]) in wrapped]

    def take_out(self, model: nn.Module, name: str) -> None:
        """The module named ``name`` runs in half precision again (an island :meth:`add` put on)."""
        module = next((m for n, m in model.named_modules() if n and clean_name(n) == name), None)
        mine = [entry for entry in self._installed if entry[0] is module]
        put_back(mine)
        self._installed = [entry for entry in self._installed if entry[0] is not module]
        self.names = [n for n in self.names if n != name]

    def remove(self) -> None:
        """Restore every wrapped module exactly as it was."""
        put_back(self._installed)
        self._installed = []
        self.names = []
