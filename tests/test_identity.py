"""What users hold, resolved by type: every known wrapper unwrapped, nested and subclassed; nothing else touched."""

import sys
import types

import pytest
import torch

from lightning_amp_plus import _identity
from lightning_amp_plus._identity import is_compiled_wrapper, resolve_module, resolve_optimizer


def fake_wrapper_module(monkeypatch, module_name, class_name):
    """The wrapper's module as imported, holding only a wrapper class of that name (the real one stays untouched)."""
    module = types.ModuleType(module_name)
    wrapper = type(class_name, (), {})
    setattr(module, class_name, wrapper)
    monkeypatch.setitem(sys.modules, module_name, module)
    return wrapper


KNOWN = [  # written out: a test reading the package's own table would follow a typo in it
    ("lightning.pytorch.core.optimizer", "LightningOptimizer", "_optimizer"),
    ("pytorch_lightning.core.optimizer", "LightningOptimizer", "_optimizer"),
    ("lightning.fabric.wrappers", "_FabricOptimizer", "_optimizer"),
    ("lightning_fabric.wrappers", "_FabricOptimizer", "_optimizer"),
    ("lightning.fabric.wrappers", "_FabricModule", "_original_module"),
    ("lightning_fabric.wrappers", "_FabricModule", "_original_module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
]


@pytest.mark.parametrize("row", KNOWN, ids=lambda row: f"{row[0]}.{row[1]}")
def test_each_known_wrapper_is_unwrapped_nested_and_subclassed(monkeypatch, row):
    module_name, class_name, attribute = row
    wrapper = fake_wrapper_module(monkeypatch, module_name, class_name)
    inner = type("Inner", (), {})()
    outer = wrapper()
    setattr(outer, attribute, inner)
    nested = type("Subclass", (wrapper,), {})()  # a subclass of a known wrapper is that wrapper
    setattr(nested, attribute, outer)
    for_optimizers = attribute == "_optimizer"
    resolve, other = (resolve_optimizer, resolve_module) if for_optimizers else (resolve_module, resolve_optimizer)
    assert resolve(nested) is inner
    assert other(nested) is nested  # an optimizer wrapper is no module wrapper, and back
    assert is_compiled_wrapper(outer) is (class_name == "OptimizedModule")


def test_a_wrapper_of_a_module_never_imported_is_not_looked_for(monkeypatch):
    for module_name, _, _ in KNOWN:
        monkeypatch.delitem(sys.modules, module_name, raising=False)
    thing = type("Anything", (), {"_optimizer": 1, "module": 2, "_orig_mod": 3, "_original_module": 4})()
    assert resolve_optimizer(thing) is thing
    assert resolve_module(thing) is thing
    assert not is_compiled_wrapper(thing)
    assert all(name not in sys.modules for name, _, _ in KNOWN)  # and none was imported


def test_the_real_wrappers_resolve_and_a_users_own_wrapper_is_an_optimizer():
    from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    net = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    assert resolve_optimizer(LightningOptimizer(sgd)) is sgd
    assert resolve_optimizer(_FabricOptimizer(sgd, strategy=None)) is sgd

    class Lookahead(torch.optim.SGD):  # keeps an inner optimizer where Lightning's wrapper does
        pass

    own = Lookahead(net.parameters(), lr=0.1)
    own._optimizer = sgd
    assert resolve_optimizer(LightningOptimizer(own)) is own
    compiled = torch.compile(net, backend="eager")
    assert resolve_module(_FabricModule(compiled, strategy=None)) is net
    assert resolve_module(torch.nn.DataParallel(net)) is net


def test_a_type_is_looked_up_once(monkeypatch):
    calls = []
    imported = _identity._imported
    monkeypatch.setattr(_identity, "_imported", lambda *names: calls.append(names) or imported(*names))
    fresh = type("Fresh", (), {})()
    resolve_optimizer(fresh)
    assert len(calls) == len(KNOWN)  # not a wrapper: every row asked once
    resolve_optimizer(fresh)
    resolve_module(fresh)
    assert len(calls) == len(KNOWN)  # then a cached answer per type


def test_the_per_type_cache_lets_a_wrappers_class_go():
    """Lightning makes a class per LightningOptimizer: a sweep of many fits must not keep them all."""
    import gc

    from lightning.pytorch.core.optimizer import LightningOptimizer

    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    for _ in range(20):
        assert resolve_optimizer(LightningOptimizer(sgd)) is sgd
    gc.collect()
    alive = [ref() for ref in list(_identity._INNER)]
    assert sum(1 for cls in alive if cls is not None and cls.__name__ == "LightningSGD") <= 1
    assert None not in alive  # a class that went took its entry with it
