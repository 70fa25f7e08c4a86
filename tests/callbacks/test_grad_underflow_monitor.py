import math
import warnings

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_amp_plus import AmpPlusPrecision, AmpPlusWarning, GradUnderflowMonitor
from lightning_amp_plus.syncs import HostSyncCounter
from tests.helpers.listeners import listener
from tests.helpers.models import TinyModel, make_loader
from tests.helpers.trainer import make_trainer


class TinyGrads(TinyModel):
    """True gradients around 1e-7: float16 subnormals (below 2**-14) unless scaled up."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-6


def _measure(init_scale, **kwargs):
    model = TinyGrads()
    plugin = AmpPlusPrecision("16-mixed", init_scale=init_scale, min_scale=min(1.0, init_scale), **kwargs)
    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=2)
    make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=4).fit(model)
    return monitor


def test_underflow_high_at_scale_one_and_low_at_scale_2_20():
    with pytest.warns(AmpPlusWarning, match="underflow float16 while the loss scale sits at min_scale=1"):
        low_scale = _measure(1.0)
    high_scale = _measure(2.0**20)
    assert all(m["underflow_fraction"] > 0.9 for m in low_scale.measurements)
    assert all(m["underflow_fraction"] < 0.1 for m in high_scale.measurements)
    assert all(m["zero_fraction"] > 0 for m in high_scale.measurements)  # ReLU zeros: structural, not underflow
    assert len(high_scale.measurements[0]["worst"]) == 2


def test_headroom_falls_as_the_scale_grows():
    monitor = _measure(2.0**10, growth_interval=1, max_scale=2.0**20)
    scales = [m["scale"] for m in monitor.measurements]
    headroom = [m["headroom_bits"] for m in monitor.measurements]
    assert scales == [2.0**10, 2.0**11, 2.0**12, 2.0**13]
    assert all(a > b for a, b in zip(headroom, headroom[1:], strict=False))  # falls at every doubling
    assert headroom[0] - headroom[-1] == pytest.approx(3.0, abs=0.5)  # about one bit per doubling


def test_warns_when_underflow_stays_high_at_min_scale():
    model = TinyGrads()
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)
    monitor = GradUnderflowMonitor(every_n_steps=1, patience=2)
    with pytest.warns(UserWarning, match=r"underflow float16 while the loss scale sits at min_scale=1.*HINT"):
        make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=3).fit(model)


def test_with_min_scale_zero_the_floor_is_float32s_smallest_normal_and_warns_there():
    """min_scale=0 bounds the scale at 2**-126 (its inverse must stay finite): sitting there is sitting at the floor.

    Every float16 gradient is zero at that scale, so only the float32 reference tells they were lost."""
    model = TinyGrads()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**-126, min_scale=0.0)
    monitor = GradUnderflowMonitor(every_n_steps=1, patience=2, exact=True)
    with pytest.warns(UserWarning, match=r"underflow float16 while the loss scale sits at min_scale=0 "):
        make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=3).fit(model)
    assert [m["underflow_fraction"] for m in monitor.measurements] == [1.0, 1.0, 1.0]


def test_logged_and_measured_only_every_n_steps(tmp_path):
    logger = CSVLogger(tmp_path)
    monitor = GradUnderflowMonitor(every_n_steps=3)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], logger=logger, max_steps=7
    ).fit(TinyModel())
    assert [m["step"] for m in monitor.measurements] == [2, 5]  # Lightning's logging steps: the last of each 3
    with open(logger.experiment.metrics_file_path) as f:
        text = f.read()
    assert "amp/underflow_fraction" in text
    assert "amp/headroom_bits" in text


def test_one_host_transfer_per_measurement():
    class Quiet(TinyModel):  # no host read of its own: the recomputed reference step adds none
        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self(batch[0]).float(), batch[1])

        def on_before_optimizer_step(self, optimizer):
            pass

    def syncs(monitor):
        model = Quiet()
        plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
        callbacks = [monitor] if monitor else []
        trainer = make_trainer(plugins=[plugin], callbacks=callbacks, max_steps=8)
        with HostSyncCounter() as counter:
            trainer.fit(model)
        return counter.count

    # the monitor adds exactly its 2 measurements (steps 3 and 7), float32 reference included
    assert syncs(GradUnderflowMonitor(every_n_steps=4)) - syncs(None) == 2


def test_bf16_warns_and_measures_nothing():
    monitor = GradUnderflowMonitor(every_n_steps=1)
    with pytest.warns(AmpPlusWarning, match="with bf16-mixed there is no scaler"):
        make_trainer(plugins=[AmpPlusPrecision("bf16-mixed")], callbacks=[monitor], max_steps=2).fit(TinyModel())
    assert monitor.measurements == []


@pytest.mark.parametrize("exact", [True, False])
def test_figures_equal_the_definition_on_the_gradients_it_saw(tmp_path, exact):
    import math

    from tests.callbacks.test_loss_scale_monitor import read_csv

    model = TinyGrads()
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10, max_scale=2.0**24)  # part subnormal
    monitor = GradUnderflowMonitor(every_n_steps=2, per_parameter=1, exact=exact)
    seen, true = {}, {}
    batches = list(make_loader())

    def capture(optimizer, step):  # runs right after the monitor's measurement, on the same scaled gradients
        if step % 2 == 1:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            seen[step] = [p.grad.detach().clone() for p in params]
            x, y = batches[step]  # the test's own float32 reference of the same batch
            loss = torch.nn.functional.mse_loss(model(x).float(), y) * 1e-6
            true[step] = torch.autograd.grad(loss, params)

    logger = CSVLogger(tmp_path, name="run")
    trainer = make_trainer(plugins=[plugin], callbacks=[monitor], logger=logger, max_steps=5)
    plugin.listen(listener(before_unscale=capture))
    trainer.fit(model)
    assert sorted(seen) == [m["step"] for m in monitor.measurements] == [1, 3]
    rows = read_csv(logger.experiment.metrics_file_path)
    logged = {int(r["step"]): r for r in rows if r.get("amp/underflow_fraction")}
    names = [n for n, _ in model.named_parameters()]
    for m in monitor.measurements:
        grads = seen[m["step"]]
        # exact: structural where the float32 gradient is zero, lost where only float16's is below the smallest normal
        structural_masks = [(r == 0) if exact else (g == 0) for g, r in zip(grads, true[m["step"]], strict=True)]
        lost_masks = [(g.abs() < 2.0**-14) & ~z for g, z in zip(grads, structural_masks, strict=True)]
        structural = sum(int(z.sum()) for z in structural_masks)
        lost = sum(int(mask.sum()) for mask in lost_masks)
        total = sum(g.numel() for g in grads)
        fraction = lost / (total - structural)
        zeros = sum(int((g == 0).sum()) for g in grads)
        assert m["zero_fraction"] == pytest.approx(zeros / total, abs=1e-12)
        assert float(logged[m["step"]]["amp/zero_fraction"]) == pytest.approx(m["zero_fraction"], rel=1e-6)
        largest = max(float(g.abs().max()) for g in grads)
        assert m["underflow_fraction"] == pytest.approx(fraction, abs=1e-12)
        assert m["headroom_bits"] == pytest.approx(math.log2(65504.0 / largest), abs=1e-9)
        assert float(logged[m["step"]]["amp/underflow_fraction"]) == pytest.approx(fraction, rel=1e-6)
        assert float(logged[m["step"]]["amp/headroom_bits"]) == pytest.approx(m["headroom_bits"], rel=1e-6)
        per = [int(mask.sum()) / max(1, int((~z).sum())) for mask, z in zip(lost_masks, structural_masks, strict=True)]
        worst = max(range(len(per)), key=lambda i: (per[i], names[i]))
        assert m["worst"] == [{"name": names[worst], "underflow_fraction": per[worst]}]
        assert float(logged[m["step"]][f"amp/underflow/{names[worst]}"]) == pytest.approx(per[worst], rel=1e-6)
        assert m["scale"] == 2.0**10
        assert m["reference"] == ("float32" if exact else None)
        if exact:
            assert m["structural_fraction"] == pytest.approx(structural / total, abs=1e-12)
            largest_true = max(float(r.abs().max()) for r in true[m["step"]])
            assert m["true_log2_max"] == pytest.approx(math.log2(largest_true), abs=1e-6)
            fitting = 2.0 ** (math.floor(math.log2(65504.0) - math.log2(largest_true)) - 1)
            assert m["fitting_scale"] == fitting  # the largest true gradient a doubling below overflow
            still_lost = sum(int(((r != 0) & (r.abs() * fitting < 2.0**-14)).sum()) for r in true[m["step"]])
            assert m["lost_at_fitting_scale"] == pytest.approx(still_lost / (total - structural), abs=1e-12)
    assert 0 < monitor.measurements[0]["underflow_fraction"] < 1  # both kinds present: the count is discriminating


class Embedded(TinyModel):
    """A 1000-row embedding of which each batch uses 8 rows: most of its gradient is structurally zero."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 8)
        self.scale = scale

    def forward(self, x):
        tokens = (x.abs() * 3).long().clamp(max=7)  # rows 0..7 only
        return self.net(self.embed(tokens).sum(dim=1))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.scale


def test_an_embeddings_gradient_made_in_float32_is_no_part_of_the_figures():
    """An embedding runs in float32 under autocast: its gradient (mostly structural zeros) was never in float16."""
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)  # at the floor: the warning is armed
    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=10, patience=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpPlusWarning)  # no false alarm
        make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=3).fit(Embedded())
    for m in monitor.measurements:
        assert "embed.weight" not in {w["name"] for w in m["worst"]}
        assert {w["name"] for w in m["worst"]} == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
        assert m["zero_fraction"] < 0.5  # 992 of the embedding's 1000 rows are zero: not counted
        assert m["underflow_fraction"] < 0.05


class Islanded(TinyModel):
    """A float32 island's parameters and a LayerNorm get their gradients in float32; the rest in float16."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.adapter = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.net(self.adapter(self.norm(x)))


def test_only_gradients_float16_held_are_measured():
    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=10)
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0, fp32_modules=["adapter"])
    make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=2).fit(Islanded())
    measured = {w["name"] for w in monitor.measurements[0]["worst"]}
    assert measured == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    plain = GradUnderflowMonitor(every_n_steps=1, per_parameter=10)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[plain], max_steps=2).fit(
        Islanded()
    )
    assert {w["name"] for w in plain.measurements[0]["worst"]} == measured | {"adapter.weight", "adapter.bias"}


def test_tiny_gradients_in_used_rows_are_underflow():
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)
    monitor = GradUnderflowMonitor(every_n_steps=1, patience=2)
    with pytest.warns(AmpPlusWarning, match="underflow float16 while the loss scale sits at min_scale=1"):
        make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=3).fit(Embedded(scale=1e-6))
    assert all(m["underflow_fraction"] > 0.5 for m in monitor.measurements)
    assert [m["step"] for m in monitor.measurements] == [0, 1, 2]


def test_the_warning_fires_at_the_patience_th_high_measurement_and_not_before():
    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)
    monitor = GradUnderflowMonitor(every_n_steps=1, patience=3)
    steps = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append(monitor._warned)

    with pytest.warns(AmpPlusWarning, match=r"\(step 2\)"):
        make_trainer(plugins=[plugin], callbacks=[monitor, Probe()], max_steps=3).fit(TinyGrads())
    assert steps == [0, 0, 1]


class TwoOptimizers(TinyModel):
    """Manual optimization: ``a`` (normal gradients) and ``b`` (float16-subnormal gradients) step in one batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.b = torch.nn.Linear(8, 64)

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss_a = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.manual_backward(loss_a)
        opt_a.step()
        opt_a.zero_grad()
        loss_b = self.b(x).float().pow(2).mean() * 1e-3
        self.manual_backward(loss_b)
        opt_b.step()
        opt_b.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.01), torch.optim.SGD(self.b.parameters(), lr=0.01)


def test_two_optimizers_stepping_in_one_update_give_one_measurement_of_both(tmp_path):
    from tests.callbacks.test_loss_scale_monitor import read_csv

    plugin = AmpPlusPrecision("16-mixed", init_scale=1.0, min_scale=1.0)
    monitor = GradUnderflowMonitor(every_n_steps=1, patience=2)
    seen = {}

    def capture(optimizer, step):
        grads = [p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.setdefault(step, []).extend(grads)

    logger = CSVLogger(tmp_path, name="run")
    trainer = make_trainer(plugins=[plugin], callbacks=[monitor], logger=logger, max_steps=6)  # 3 batches
    plugin.listen(listener(before_unscale=capture))
    with pytest.warns(AmpPlusWarning, match=r"\(step 1\)"):  # the second measurement of b's underflow in a row
        trainer.fit(TwoOptimizers())
    assert [m["step"] for m in monitor.measurements] == [0, 1, 2]  # one record per update, not one per optimizer
    for m in monitor.measurements:
        grads = seen[m["step"]]
        zeros = sum(int((g == 0).sum()) for g in grads)
        subnormal = sum(int(((g != 0) & (g.abs() < 2.0**-14)).sum()) for g in grads)
        assert m["underflow_fraction"] == pytest.approx(subnormal / (sum(g.numel() for g in grads) - zeros))
    rows = read_csv(logger.experiment.metrics_file_path)
    last = {int(r["step"]): float(r["amp/underflow_fraction"]) for r in rows if r.get("amp/underflow_fraction")}
    assert last == {m["step"]: pytest.approx(m["underflow_fraction"]) for m in monitor.measurements}


class _LoudB(TwoOptimizers):
    """``b``'s gradients dwarf ``a``'s; at step 1 ``a``'s loss is inf, at step 2 ``b``'s is nan."""

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        step = self.trainer.global_step // 2  # each optimizer's step counts
        loss_a = torch.nn.functional.mse_loss(self.net(x).float(), y) * (float("inf") if step == 1 else 1.0)
        self.manual_backward(loss_a)
        opt_a.step()
        opt_a.zero_grad()
        loss_b = self.b(x).float().pow(2).mean() * 100.0 * (float("nan") if step == 2 else 1.0)
        self.manual_backward(loss_b)
        opt_b.step()
        opt_b.zero_grad()


def test_the_headroom_of_an_update_is_of_the_largest_gradient_of_every_optimizer_and_none_when_one_is_nan_or_inf():
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    monitor = GradUnderflowMonitor(every_n_steps=1)
    seen = {}

    def capture(optimizer, step):
        grads = [p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.setdefault(step, []).append(max(float(g.abs().max()) for g in grads))

    trainer = make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=8)  # 4 batches
    plugin.listen(listener(before_unscale=capture))
    trainer.fit(_LoudB())
    assert [m["step"] for m in monitor.measurements] == [0, 1, 2, 3]
    for step in (0, 3):
        a, b = seen[step]
        assert b > a  # the second optimizer's gradient is the update's largest
        assert monitor.measurements[step]["headroom_bits"] == pytest.approx(math.log2(65504.0 / b))
    assert [m["headroom_bits"] for m in monitor.measurements[1:3]] == [None, None]  # inf in a, then nan in b


def test_a_second_trainer_starts_its_measurements_afresh():
    monitor = GradUnderflowMonitor(every_n_steps=1)
    for _ in range(2):  # each fit measures step 0 only: the second must not merge into the first's record
        make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], max_steps=1).fit(
            TinyModel()
        )
        assert [m["step"] for m in monitor.measurements] == [0]


def test_the_warning_rule_boundaries_and_its_words():
    """At the floor and at >= warn_fraction a measurement is high; `patience` high ones in a row warn, then count
    again; above the floor resets; at most `max_warnings` warnings. The message word for word."""
    import warnings
    from types import SimpleNamespace

    monitor = GradUnderflowMonitor(every_n_steps=1, warn_fraction=0.5, patience=2, max_warnings=2)
    monitor._plugin = SimpleNamespace(scaler=SimpleNamespace(knobs=lambda: {"min_scale": 1.0}))
    fractions = [0.5, 0.6, 0.49, 0.5, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9]
    warned_at = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, fraction in enumerate(fractions):
            before = len(caught)
            monitor._check({"scale": 1.0, "underflow_fraction": fraction, "step": step})
            if len(caught) > before:
                warned_at.append(step)
    assert warned_at == [1, 4]  # 0.49 broke the run at step 2; the third warning is never given
    assert str(caught[0].message) == (
        "`GradUnderflowMonitor`: 60% of gradient elements underflow float16 while the loss scale sits at"
        " min_scale=1 (step 1). HINT: raise `min_scale` or `init_scale`, use precision='bf16-mixed', or keep the"
        " layers with tiny gradients in float32 (`AmpPlusPrecision(fp32_modules=[...])`)."
    )
    monitor = GradUnderflowMonitor(every_n_steps=1, warn_fraction=0.5, patience=2)
    monitor._plugin = SimpleNamespace(scaler=SimpleNamespace(knobs=lambda: {"min_scale": 1.0}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, scale in enumerate([1.0, 2.0, 1.0, 1.0]):  # above the floor at step 1: not high
            monitor._check({"scale": scale, "underflow_fraction": 0.8, "step": step})
    assert [str(w.message).split("(step ")[1][:1] for w in caught] == ["3"]


class _FrozenAndSparse(TinyModel):
    """An unused parameter (its gradient stays None) and a sparse embedding (a sparse gradient: not measured)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.ones(3))
        self.sparse = torch.nn.Embedding(10, 8, sparse=True)

    def forward(self, x):
        return self.net(x + self.sparse(torch.zeros(x.shape[0], dtype=torch.long)))


def test_parameters_without_a_dense_gradient_are_left_out_of_the_measurement():
    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=10)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], max_steps=2).fit(
        _FrozenAndSparse()
    )
    assert len(monitor.measurements) == 2
    named = {w["name"] for m in monitor.measurements for w in m["worst"]}
    assert named == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}


class _ExtraTensor(TinyModel):
    """The optimizer also holds a leaf tensor that is no parameter of the module (a learned temperature, say)."""

    def __init__(self):
        super().__init__()
        self.temperature = torch.ones(3, requires_grad=True)

    def forward(self, x):
        return self.net(x) * self.temperature.sum().half()  # its gradient held in float16 (a cast's, on any torch)

    def configure_optimizers(self):
        return torch.optim.SGD([*self.parameters(), self.temperature], lr=0.01)


def test_a_tensor_the_module_does_not_name_is_measured_by_its_shape():
    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=10)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], max_steps=1).fit(
        _ExtraTensor()
    )
    (measurement,) = monitor.measurements
    assert "<unnamed (3,)>" in {w["name"] for w in measurement["worst"]}


def test_a_sharded_measurement_sums_the_ranks_and_takes_the_largest_gradient(monkeypatch):
    """Each rank measures its shards (a parameter may have no gradient on a rank); the counts are summed and the
    largest gradient is the largest of the ranks': with a second rank holding nothing, the figures are this rank's,
    and the parameter without a gradient counts no element."""
    from lightning_amp_plus.callbacks import grad_underflow_monitor
    from tests.helpers.sharded import FakePeer

    def fit(sharded):
        torch.manual_seed(0)
        monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=10)
        trainer = make_trainer(
            plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], max_steps=2
        )
        with monkeypatch.context() as patch:
            if sharded:
                peer = FakePeer(patch, lambda tensor, op: torch.zeros_like(tensor))
                patch.setattr(grad_underflow_monitor, "shards_gradients", lambda trainer: True)
            trainer.fit(_FrozenAndSparse())
        return monitor.measurements, (peer.calls if sharded else None)

    plain, _ = fit(False)
    sharded, calls = fit(True)
    sum_, max_ = torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX
    assert [c["op"] for c in calls] == [sum_, max_] * 2  # one sum of the counts, one max of the largest, per step
    keys = ("step", "scale", "underflow_fraction", "zero_fraction", "headroom_bits", "worst")
    assert [{k: m[k] for k in keys} for m in sharded] == [{k: m[k] for k in keys} for m in plain]


def test_a_rank_holding_no_gradient_element_still_joins_the_sums_and_reports_the_others(monkeypatch):
    """A rank whose shards are all empty measures nothing itself, yet joins both reductions (or the others would
    wait for it): its figures are the other rank's, here every parameter with 1 of its 4 elements below float16's
    smallest normal, none zero, and a largest gradient of 2."""
    from lightning_amp_plus.callbacks import grad_underflow_monitor
    from tests.helpers.sharded import FakePeer

    def other_rank(tensor, op):
        if op == torch.distributed.ReduceOp.MAX:
            return torch.full_like(tensor, 2.0)
        n = (tensor.numel() - 1) // 4  # the loss, then per parameter: zeros, below, elements, structural zeros
        return torch.cat([torch.ones(1), torch.tensor([0.0, 1.0, 4.0, 0.0]).repeat(n)])

    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=10)
    trainer = make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], max_steps=1)
    FakePeer(monkeypatch, other_rank)
    monkeypatch.setattr(grad_underflow_monitor, "shards_gradients", lambda trainer: True)
    monkeypatch.setattr(grad_underflow_monitor, "local_tensor", lambda grad: grad.flatten()[:0])
    trainer.fit(TinyModel())
    (m,) = monitor.measurements
    assert (m["underflow_fraction"], m["zero_fraction"]) == (0.25, 0.0)
    assert m["headroom_bits"] == math.log2(65504.0 / 2.0)
    assert sorted(w["name"] for w in m["worst"]) == sorted(n for n, _ in TinyModel().named_parameters())
    assert {w["underflow_fraction"] for w in m["worst"]} == {0.25}


@pytest.mark.parametrize(
    ("name", "least"), [("every_n_steps", 1), ("per_parameter", 0), ("patience", 1), ("max_warnings", 0)]
)
def test_each_count_argument_is_refused_below_its_least_value_by_name(name, least):
    with pytest.raises(
        ValueError, match=rf"^`GradUnderflowMonitor\({name}={least - 1}\)` is invalid: expected an int >= {least}\.$"
    ):
        GradUnderflowMonitor(**{name: least - 1})
    assert getattr(GradUnderflowMonitor(**{name: least}), name) == least


def test_one_non_zero_element_below_the_smallest_normal_is_all_of_the_underflow():
    from lightning_amp_plus.callbacks.grad_underflow_monitor import underflow_fraction

    assert underflow_fraction(below=1, zeros=0, total=1) == 1.0
    assert underflow_fraction(below=3, zeros=2, total=3) == 1.0  # two zeros left out, the one other element lost


class _Still(TinyModel):
    """A loss that does not move with the parameters: every gradient element is an exact zero."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 0.0


def test_all_zero_gradients_have_neither_an_underflow_nor_a_headroom_figure():
    monitor = GradUnderflowMonitor(every_n_steps=1)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], max_steps=1).fit(
        _Still()
    )
    (m,) = monitor.measurements
    # every gradient zero: no fraction of non-zero elements exists (absent, never a healthy-looking 0)
    assert (m["zero_fraction"], m["underflow_fraction"], m["headroom_bits"]) == (1.0, None, None)
    assert m["loss"] is not None


def test_a_monitor_left_out_of_the_next_fit_measures_nothing_there():
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    monitor = GradUnderflowMonitor(every_n_steps=1)
    make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=2).fit(TinyModel())
    assert len(monitor.measurements) == 2
    make_trainer(plugins=[plugin], max_steps=2).fit(TinyModel())  # the same plugin, without the monitor
    assert len(monitor.measurements) == 2


class _FailsOnce(TinyModel):
    """The first fit fails at step 3 after its gradients were measured (step 3's gradient holds an inf)."""

    failing = True

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        if self.failing and self.trainer.global_step == 3:
            raise RuntimeError("boom")


def test_a_retry_on_the_same_trainer_measures_the_failed_step_afresh():
    plugin = AmpPlusPrecision("16-mixed", init_scale=1024.0)
    monitor = GradUnderflowMonitor(every_n_steps=1)
    seen = {}
    trainer = make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=5)
    model = _FailsOnce(grad_poison={3: "net.2.bias"})
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model)
    model.failing, model.grad_poison = False, {}
    plugin.listen(
        listener(
            before_unscale=lambda optimizer, step: seen.setdefault(
                step, max(float(p.grad.abs().max()) for g in optimizer.param_groups for p in g["params"])
            )
        )
    )
    trainer.fit(model)
    # each attempt's measurement of step 3 is its own (the failed one saw the inf), never one merged record
    assert [m["step"] for m in monitor.measurements] == [0, 1, 2, 3, 3, 4]
    assert monitor.measurements[3]["headroom_bits"] is None
    assert monitor.measurements[4]["headroom_bits"] == pytest.approx(math.log2(65504.0 / seen[3]))


def test_an_overflowed_update_has_no_underflow_figure(tmp_path):
    from tests.callbacks.test_loss_scale_monitor import read_csv

    logger = CSVLogger(tmp_path, name="run")
    monitor = GradUnderflowMonitor(every_n_steps=1, per_parameter=2)
    make_trainer(
        plugins=[AmpPlusPrecision("16-mixed", init_scale=1024.0)], callbacks=[monitor], logger=logger, max_steps=4
    ).fit(TinyModel(grad_poison={2: "net.0.weight"}))
    by_step = {m["step"]: m for m in monitor.measurements}
    assert by_step[2]["underflow_fraction"] is None  # no fraction exists on an overflowed update
    assert by_step[2]["headroom_bits"] is None
    assert "worst" not in by_step[2]
    assert all(by_step[s]["underflow_fraction"] is not None for s in (0, 1, 3))
    rows = {int(r["step"]): r for r in read_csv(logger.experiment.metrics_file_path) if r.get("amp/zero_fraction")}
    assert not rows[2].get("amp/underflow_fraction")  # absent in the logger too, never a healthy-looking 0
    assert not any(k.startswith("amp/underflow/") and v for k, v in rows[2].items())
    assert rows[3].get("amp/underflow_fraction")


class _Dropped(TinyModel):
    """Half the hidden units dropped each step: their weights' gradients are exactly zero, structurally."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 1))


def test_the_reference_draws_the_dropout_masks_the_step_drew():
    torch.manual_seed(0)
    monitor = GradUnderflowMonitor(every_n_steps=1, exact=True)
    plugin = AmpPlusPrecision("16-mixed", init_scale=2.0**10)
    make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=6).fit(_Dropped())
    for m in monitor.measurements:
        assert m["reference"] == "float32"
        # the zeros the step's masks made are the reference's zeros, no more and no fewer: other masks would leave
        # some of them non-zero in float32 (counted lost) and add zeros of their own
        assert m["structural_fraction"] == m["zero_fraction"] > 0.01  # units every sample dropped
        assert m["underflow_fraction"] == 0.0


def test_a_reference_that_raises_is_told_and_the_run_goes_on():
    class Fails(TinyModel):
        def training_step(self, batch, batch_idx):
            from lightning_amp_plus.forensics._safe import replaying

            if replaying():
                raise RuntimeError("not twice")
            return super().training_step(batch, batch_idx)

    monitor = GradUnderflowMonitor(every_n_steps=1, exact=True)
    make_trainer(plugins=[AmpPlusPrecision("16-mixed")], callbacks=[monitor], max_steps=2).fit(Fails())
    assert [m["reference"] for m in monitor.measurements] == [None, None]
    assert monitor.measurements[0]["reference_error"] == (
        "the float32 reference's `training_step` raised RuntimeError: not twice"
    )
    assert monitor.measurements[0]["underflow_fraction"] is not None  # measured without it
