"""What the default path needs to stay safe, with no opt-in imported: a call that never raises, and two facts.

:func:`attempt` turns what a call raises into a told outcome (the training run goes on); :func:`replaying` says a
replay is running (the hooks that record a batch ignore its calls; the opt-in sandbox counts them in
:data:`replays`); :func:`torch_own` says whether all a module runs is torch's own code (a default path may time it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, TypeVar

import torch

T = TypeVar("T")
#: replays in progress (the opt-in sandbox counts them): the hooks that record a batch ignore their calls
replays = [0]


def replaying() -> bool:
    """Whether a replay is running (hooks that record or measure a batch ignore the calls it makes)."""
    return replays[0] > 0


def torch_own(module: torch.nn.Module) -> bool:
    """Whether all ``module`` runs is torch's own code (``nn.Linear``), not yours: a default path may run it again.

    Its class is torch's (a subclass of yours may override any method its forward calls), with no forward of its
    own, no hook (its own or global), no parametrization, and its children the same.
    """
    from torch.nn.modules import module as torch_module
    from torch.nn.utils import parametrize

    return (
        type(module).__module__.startswith("torch.")
        and "forward" not in vars(module)
        and not (module._forward_hooks or module._forward_pre_hooks)
        and not (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)
        and not parametrize.is_parametrized(module)
        and all(torch_own(child) for child in module.children())
    )


def attempt(run: Callable[..., T], *args: Any) -> tuple[Optional[T], Optional[str]]:
    """``run(*args)``'s result and None, or None and what it raised (``"RuntimeError: ..."``): never raises."""
    try:
        return run(*args), None
    except Exception as error:  # a told outcome: the training run goes on
        return None, raised(error)


def raised(error: BaseException) -> str:
    """``"RuntimeError: the message"`` (its first line, at most 200 characters)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
