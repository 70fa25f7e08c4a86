"""What the watch costs a step: a module called many times a step, watched and not, and a parent-linked tree walked.

The watch (``NaNSkipReporter``'s, after the first forward-born skip) reads each module call's inputs and output on
the device. This times the same float16 forward (where the watch runs) clean, with two global hooks that do nothing
(what torch's dispatch of a hooked call costs, hooks of any kind), and watched, on models that call modules many
times a step: an ``LSTMCell`` in a Python loop (``--calls`` steps) and a weight-tied block applied ``--calls`` times.
A fourth kind, the bare reads: two hooks that keep one ``aminmax`` per tensor in and out, and nothing else (no module
filter, no trace, no read-once cache). A fifth, the essential watch: what a watch that names the right module cannot
leave out, written as lean as Python allows (the module filter, this thread only, a trace entry a call, per tensor the
checks that it can be read, the read-once cache, one ``aminmax`` with grad off, an output's autograd node); none of
ours beyond (your hooks, the step's own inputs per sample, keyword arguments, the reasons a call went unread, never
raising). It prints the fastest of each (noise only adds time) and the cost per watched call: ours, the essential
watch's, the bare reads' and torch's. Then it walks
a tree of dataclass nodes with parent links, as the watch walks a call's arguments, against the same tree without
the links.

    python examples/watch_cost.py [--calls 200] [--repeats 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any


def parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so ``--help`` answers at once."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200, help="module calls a step")
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards of each kind (the fastest is printed)")
    parser.add_argument("--depth", type=int, default=7, help="depth of the walked tree (3 children a node)")
    return parser


if __name__ == "__main__":
    parser().parse_args()  # --help, or a mistyped flag, before the seconds torch takes to import

import torch
from torch import nn

from lightning_amp_plus.forensics._tree import tensors
from lightning_amp_plus.forensics.observe import Watch, batch_rows


class Recurrent(nn.Module):
    """An LSTM cell stepped in a Python loop, one call a time step."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.cell, self.head = nn.LSTMCell(width, width), nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[1], x.shape[2])
        for step in x:
            h, c = self.cell(step, (h, c))
        return self.head(h)


class Tied(nn.Module):
    """One block applied ``calls`` times (weights tied across depth)."""

    def __init__(self, calls: int, width: int = 32) -> None:
        super().__init__()
        self.block, self.calls = nn.Linear(width, width), calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.calls):
            x = torch.tanh(self.block(x))
        return x.sum(1, keepdim=True)


def _forward(model: nn.Module, x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        model(x)


def _noop(*args: Any) -> None:
    return None


def _floor(kept: list[Any]) -> Any:
    """A global hook that keeps one ``aminmax`` of each tensor its call takes (pre) or gives (post), under no_grad."""

    def hook(module: nn.Module, args: Any, *output: Any) -> None:
        with torch.no_grad():
            for value in output or args:
                for t in value if isinstance(value, tuple) else (value,):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        kept.append(torch.aminmax(t))

    return hook


class Essential:
    """The least a watch that names the right module does a call (the fifth kind): see the module's docstring."""

    def __init__(self, model: nn.Module) -> None:
        import threading

        self.index = {id(m): i for i, m in enumerate(model.modules()) if m is not model}
        self.trace: list[Any] = []
        self.open: list[Any] = []
        self.read: dict[int, Any] = {}
        self.thread = threading.get_ident()
        self.ident = threading.get_ident

    def reads(self, values: Any, nodes: bool) -> list[Any]:
        import weakref

        found, read, wrapped = [], self.read, torch._C._functorch.is_functorch_wrapped_tensor
        for value in values:
            for t in value if type(value) in (tuple, list) else (value,):
                if type(t) is not torch.Tensor or not t.is_floating_point():
                    continue
                if t.is_nested or t.is_meta or t.layout is not torch.strided or wrapped(t):
                    continue
                hit = read.get(id(t))
                if hit is not None and hit[0]() is t and t._version == hit[1]:
                    entry = hit[2]
                else:
                    entry = (t.dtype in (torch.float16, torch.bfloat16), torch.aminmax(t))
                    read[id(t)] = (weakref.ref(t), t._version, entry)
                if nodes:
                    node = t.grad_fn
                    found.append((*entry, None if node is None else node._sequence_nr()))
                else:
                    found.append(entry)
        return found

    def before(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
            return
        index = self.index.get(id(module))
        if index is None or self.ident() != self.thread:
            return
        grad = torch._C.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            with torch._C.DisableTorchFunction():
                took = self.reads(args, False)
        finally:
            torch._C._set_grad_enabled(grad)
        self.open.append((len(self.trace), index))
        self.trace.append((index, took))

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self.open:
            return
        position, index = self.open[-1]
        if self.index.get(id(module)) != index:
            return
        self.open.pop()
        grad = torch._C.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            with torch._C.DisableTorchFunction():
                gave = self.reads((output,), True)
        finally:
            torch._C._set_grad_enabled(grad)
        self.trace.append((~index, gave))


def time_forward(model: nn.Module, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """The fastest seconds of a forward (its graph built, as in training), three ways, interleaved.

    Clean; with two global hooks that do nothing (torch's cost of a hooked call); watched. Interleaved, so drift hits
    all three alike.
    """
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    watch = Watch()
    times: dict[str, list[float]] = {"clean": [], "hooked": [], "floor": [], "essential": [], "watched": []}
    kept: list[Any] = []
    for round_ in range(repeats + 2):
        for kind in times:
            handles = []
            if kind == "hooked":
                handles = [register_module_forward_pre_hook(_noop), register_module_forward_hook(_noop)]
            if kind == "floor":  # the least a watch can do: one kept aminmax per tensor in and out, nothing else
                kept.clear()
                handles = [register_module_forward_pre_hook(_floor(kept)), register_module_forward_hook(_floor(kept))]
            if kind == "essential":  # the least a watch that names the right module does
                essential = Essential(model)
                handles = [
                    register_module_forward_pre_hook(essential.before),
                    register_module_forward_hook(essential.after),
                ]
            if kind == "watched":
                watch.install(model)
                watch.begin(batch_rows(x))
            start = time.perf_counter()
            _forward(model, x)
            took = time.perf_counter() - start
            calls = len(watch.trace or ()) // 2
            watch.remove()
            for handle in handles:
                handle.remove()
            if round_ >= 2:
                times[kind].append(took)
    # the fastest of each: this machine's noise only ever adds time
    fastest: dict[str, float] = {kind: min(values) for kind, values in times.items()}
    fastest["calls"] = calls
    return fastest


@dataclasses.dataclass
class Node:
    value: torch.Tensor
    parent: Any = None
    children: list[Any] = dataclasses.field(default_factory=list)


def tree(depth: int, linked: bool, parent: Any = None) -> Node:
    node = Node(torch.zeros(1), parent if linked else None)
    if depth:
        node.children = [tree(depth - 1, linked, node) for _ in range(3)]
    return node


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    figures: dict[str, Any] = {}
    cases = {
        "LSTMCell loop": (Recurrent(), torch.randn(args.calls, 16, 32)),
        "tied block": (Tied(args.calls), torch.randn(16, 32)),
    }
    for name, (model, x) in cases.items():
        t = time_forward(model, x, args.repeats)
        calls = int(t["calls"])
        ours = (t["watched"] - t["hooked"]) / calls * 1e6
        torchs = (t["hooked"] - t["clean"]) / calls * 1e6
        floor = (t["floor"] - t["hooked"]) / calls * 1e6
        essential = (t["essential"] - t["hooked"]) / calls * 1e6
        figures[name] = {
            **t,
            "us_per_call_ours": ours,
            "us_per_call_torch_hooks": torchs,
            "us_per_call_floor": floor,
            "us_per_call_essential": essential,
        }
        print(
            f"{name} forward: clean {t['clean'] * 1e3:.2f} ms, torch's hooks alone {t['hooked'] * 1e3:.2f} ms, "
            f"bare reads {t['floor'] * 1e3:.2f} ms ({t['floor'] / t['clean']:.2f}x), "
            f"essential watch {t['essential'] * 1e3:.2f} ms ({t['essential'] / t['clean']:.2f}x), "
            f"watched {t['watched'] * 1e3:.2f} ms ({t['watched'] / t['clean']:.2f}x clean); {calls} watched calls: "
            f"{ours:.1f} us a call ours, {essential:.1f} us the essential watch, {floor:.1f} us the bare reads, "
            f"{torchs:.1f} us torch's hooked dispatch"
        )
    for linked in (False, True):
        root = tree(args.depth, linked)
        start = time.perf_counter()
        count = sum(1 for _ in tensors(root))
        took = time.perf_counter() - start
        figures["tree linked" if linked else "tree"] = {"tensors": count, "ms": took * 1e3}
        print(f"tree of {count} nodes{' with parent links' if linked else ''}: walked in {took * 1e3:.1f} ms")
    return figures


if __name__ == "__main__":
    main()
