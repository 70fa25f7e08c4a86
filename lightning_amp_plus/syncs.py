"""Host-sync accounting: count every point where the host waits for device values.

:class:`HostSyncCounter` counts, in a block of code:

* ``aten._local_scalar_dense`` dispatches (``.item()``, ``float(t)``, ``bool(t)``, torch's own skip decision);
* device-to-host copies (``aten._to_copy`` / ``aten.copy_`` from a non-CPU tensor to the CPU);
* the package's own deliberate transfers through :func:`to_host`, also for CPU tensors, where ``tolist()``
  dispatches nothing: so a CPU-only test sees exactly the transfers a GPU run would make.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_ACTIVE: list[HostSyncCounter] = []
_QUIET: list[bool] = []  # inside `FlagPeek`: a non-blocking copy is no wait
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def to_host(tensor: Tensor) -> list[Any]:
    """``tensor.tolist()``: one host transfer, counted by any active :class:`HostSyncCounter`."""
    if tensor.device.type == "cpu":
        for counter in _ACTIVE:
            counter.count += 1
    return tensor.tolist()


class HostSyncCounter(TorchDispatchMode):
    """Count host syncs deterministically, on any device, so a test can assert a sync budget.

    It sees the ops of the thread it runs in.

    Example:
        >>> import torch
        >>> from lightning_amp_plus.syncs import HostSyncCounter, to_host
        >>> with HostSyncCounter() as counter:
        ...     x = torch.ones(3).sum()
        ...     y = float(x)
        ...     z = to_host(torch.ones(2))
        >>> counter.count
        2
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __enter__(self) -> HostSyncCounter:
        _ACTIVE.append(self)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *args: Any) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _QUIET:
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        elif func in _COPIES:
            out = func(*args, **kwargs)
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = out  # `copy_` returns the tensor it copied into
            if (
                isinstance(source, Tensor)
                and isinstance(target, Tensor)
                and source.device.type != "cpu"
                and target.device.type == "cpu"
            ):
                self.count += 1
            return out
        return func(*args, **kwargs)


class FlagPeek:
    """A device flag read later without waiting: a non-blocking copy and an event on CUDA; host memory at once.

    :meth:`value` returns the flag when it is on the host, ``None`` while the device is still busy (unless ``wait``,
    which waits, and counts as a host sync). Reading host memory dispatches nothing: a peek is never a sync.

    Example:
        >>> import torch
        >>> with HostSyncCounter() as counter:
        ...     peek = FlagPeek(torch.tensor(1.0))
        ...     peek.value()
        1.0
        >>> counter.count
        0
    """

    def __init__(self, tensor: Tensor) -> None:
        self._event: Any = None
        _QUIET.append(True)
        try:
            if tensor.device.type == "cuda":
                self._copy = tensor.detach().to("cpu", non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                self._copy = tensor.detach()
        finally:
            _QUIET.pop()

    def value(self, wait: bool = False) -> float | None:
        """The flag's value once it is on the host; ``None`` while it is not (and ``wait`` is False)."""
        if self._event is not None and not self._event.query():
            if not wait:
                return None
            for counter in _ACTIVE:
                counter.count += 1  # a wait: a host sync
            self._event.synchronize()
        return float(self._copy.flatten().tolist()[0])
