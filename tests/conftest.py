import os
import sys
import warnings

import pytest
import torch

os.environ.setdefault("PL_DISABLE_FORK", "1")

from lightning_amp_plus import _warnings  # noqa: E402

if "mutmut" in sys.modules:  # a mutation run: its trampolines sit between a mutated function and its caller
    _warnings._LIBRARIES = _warnings._LIBRARIES | {"mutmut"}

try:  # property tests: 60 examples each in CI (seconds); HYPOTHESIS_PROFILE=deep for 1,000
    from hypothesis import settings

    settings.register_profile("ci", max_examples=60, print_blob=True)
    settings.register_profile("deep", max_examples=1000)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_lightning() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_watch_left():
    """No test leaves a global module hook on: a watch that outlived its fit would watch every later test."""
    from torch.nn.modules import module

    yield
    left = len(module._global_forward_hooks) + len(module._global_forward_pre_hooks)
    module._global_forward_hooks.clear()
    module._global_forward_pre_hooks.clear()
    assert not left, f"{left} global module hooks were left on"
