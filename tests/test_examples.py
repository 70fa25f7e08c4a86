"""Every example runs at tiny size (smoke tests), and the YAML config builds the plugin and both callbacks."""

import glob
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_amp_plus import AmpPlusPrecision, LossScaleMonitor, NaNSkipReporter

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_main_example_writes_the_scale_curve(tmp_path, capsys):
    from examples.train_transformer import main

    png = main(["--fast", "--out", str(tmp_path)])
    assert os.path.getsize(png) > 1000
    out = capsys.readouterr().out
    assert f"scale curve written to {png}" in out
    assert json.loads((tmp_path / "skips.json").read_text())["num_steps"] == 6
    tail = out[out.index(f"scale curve written to {png}") :].splitlines()[1:]
    assert tail[0].startswith("AmpAdvisor: ")  # the example ends with the advisor's output
    verdict = [line for line in tail if not line.startswith("speed hint [")]  # hints (this machine's) after it
    assert not any("[fused_optimizer]" in line or "[silent_fp32]" in line for line in verdict)
    assert (tmp_path / "advice.md").read_text().startswith("# AmpAdvisor\n")


def _before_after(out: str, what: str) -> tuple[float, float]:
    """The ``{what} A -> B`` figures an example prints (3 decimals)."""

    first, last = re.search(rf"\b{what} (-?[0-9.]+) -> (-?[0-9.]+)", out).groups()
    return float(first), float(last)


def test_accumulation_example_sees_true_gradients(tmp_path, capsys):
    from examples.grad_accumulation import main

    model = main(["--fast", "--accumulate", "2", "--out", str(tmp_path)])
    first, last = _before_after(capsys.readouterr().out, "loss")
    assert first == pytest.approx(model.losses[0], abs=5e-4)  # the printed window: one batch at this size
    assert last == pytest.approx(model.losses[-1], abs=5e-4)
    assert len(model.grad_norms) == 3
    finite = [n for n in model.grad_norms if n == n and n != float("inf")]  # an overflowing step shows inf
    assert finite
    assert all(0 < n < 100 for n in finite)


def test_the_benchmarks_reference_row_measures_the_reference():
    """The float32 reference's cost is the monitor with it against the monitor without it: two different runs."""
    from examples.benchmark import configs

    table = configs("cpu", "16-mixed")
    (reference,) = table["+ GradUnderflowMonitor(exact=True)"]()[1]
    (plain,) = table["+ GradUnderflowMonitor()"]()[1]
    assert (reference.exact, plain.exact) == (True, False)


def test_benchmark_smoke(capsys):
    from examples.benchmark import main

    rows = main(["--device", "cpu", "--steps", "3", "--rounds", "1", "--warmup", "1", "--size", "small"])
    assert [r["config"] for r in rows] == [
        "fp32",
        "stock AMP",
        "AmpPlusPrecision",
        "AmpPlusPrecision + callbacks",
        "AmpPlusPrecision + callbacks, watching",
        "AmpPlusPrecision + callbacks + AmpAdvisor",
        "AmpPlusPrecision(auto_islands=True)",
        "+ GradUnderflowMonitor(exact=True)",
        "+ GradUnderflowMonitor()",
        "stock AMP + 2 empty callbacks",
        "AmpPlusPrecision + 2 empty callbacks",
    ]
    assert rows[1]["syncs_per_step"] == 1.0
    assert rows[2]["syncs_per_step"] == rows[3]["syncs_per_step"] == rows[1]["syncs_per_step"]  # none of our own
    assert rows[4]["syncs_per_step"] == rows[1]["syncs_per_step"]  # the watch adds none: read only on a skip
    assert rows[5]["syncs_per_step"] == rows[1]["syncs_per_step"]  # the advisor adds none between measurements
    assert rows[6]["syncs_per_step"] == rows[1]["syncs_per_step"]  # auto_islands adds none on a clean step
    assert rows[1]["us_over_stock"] == 0.0  # the paired difference of stock with itself
    out = capsys.readouterr().out
    assert "MLP (256, 512, 4) batch 8 SGD clip 1.0" in out
    assert "| AmpPlusPrecision + callbacks |" in out
    assert "us/step over stock" in out
    assert "float32 reference (one float32 forward and backward every log_every_n_steps=50):" in out


def test_cli_builds_everything_from_yaml(tmp_path, monkeypatch, capsys):
    from examples.cli import main

    monkeypatch.chdir(tmp_path)
    config = os.path.abspath(os.path.join(EXAMPLES, "config.yaml"))
    cli = main(["fit", "--config", config, "--trainer.max_steps", "5"])
    model = cli.model
    first, last = _before_after(capsys.readouterr().out, "loss")
    assert first == pytest.approx(model.losses[0], abs=5e-4)
    assert last == pytest.approx(model.losses[-1], abs=5e-4)
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, AmpPlusPrecision)
    assert plugin.scaler.get_growth_interval() == 20
    assert plugin.scaler.hysteresis == 2
    assert plugin.history.num_steps == 5
    assert plugin.fp32_modules[0] is torch.nn.LayerNorm
    assert plugin.fp32_module_names == []  # installed while fitting, removed at teardown
    kinds = {type(c) for c in cli.trainer.callbacks}
    assert {LossScaleMonitor, NaNSkipReporter} <= kinds
    assert (tmp_path / "runs" / "cli" / "skips.json").exists()


def test_a_config_saved_by_0_2_with_null_knobs_still_builds_the_plugin(tmp_path, monkeypatch):
    """0.2's LightningCLI wrote every knob it defaulted to None as `null` into each run's config.yaml."""
    import yaml

    from examples.cli import main

    monkeypatch.chdir(tmp_path)
    with open(os.path.join(EXAMPLES, "config.yaml")) as f:
        config = yaml.safe_load(f)
    knobs = config["trainer"]["plugins"][0]["init_args"]
    knobs.update(growth_factor=None, backoff_factor=None, max_scale=None)  # as 0.2's `--print_config` saved them
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(config))
    cli = main(["fit", "--config", str(tmp_path / "saved.yaml"), "--trainer.max_steps", "2"])
    scaler = cli.trainer.precision_plugin.scaler
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.max_scale) == (2.0, 0.5, 2.0**24)
    assert scaler.get_growth_interval() == 20  # the values the config gives are kept


@pytest.mark.slow
def test_fsdp_example_runs_on_two_cpu_processes(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(EXAMPLES)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "fsdp.py"), "--fast", "--out", str(tmp_path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    from tests.helpers.sharded import ended

    assert ended(done), (done.returncode, done.stderr[-3000:])  # torch's gloo abort at exit aside (pytorch#190489)
    assert "rank 0 of 2: updates 8, applied 6, skipped at step [3, 4]" in done.stdout
    assert done.stdout.count("rank 0 of 2") == 1
    assert json.loads((tmp_path / "skips.json").read_text())["skipped_steps"] == [3, 4]


#: the examples with a command line of their own (cli.py is LightningCLI's: its help is built from the classes)
ARGPARSE = sorted(
    os.path.splitext(os.path.basename(path))[0]
    for path in glob.glob(os.path.join(EXAMPLES, "*.py"))
    if re.search(r"^import argparse$", Path(path).read_text(), re.MULTILINE)
)


def test_every_flag_of_every_example_says_what_it_does():
    assert {"train_transformer", "benchmark", "fsdp", "gan_manual", "grad_accumulation"} <= set(ARGPARSE)
    for name in ARGPARSE:
        parser = importlib.import_module(f"examples.{name}").parser()
        for action in parser._actions:
            assert (action.help or "").strip(), f"examples/{name}.py: {action.option_strings} has no help"


@pytest.mark.parametrize("name", ARGPARSE)
def test_an_examples_help_answers_before_torch_is_imported(name):
    probe = (
        "import runpy, sys\n"
        "path = sys.argv[1]\n"
        "sys.argv = [path, '--help']\n"
        "try:\n"
        "    runpy.run_path(path, run_name='__main__')\n"
        "except SystemExit as done:\n"
        "    print('exit', done.code, sorted(m for m in ('torch', 'lightning') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, os.path.join(EXAMPLES, f"{name}.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.path.dirname(EXAMPLES), "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: {name}.py [-h]")
    assert done.stdout.rstrip().endswith("exit 0 []")  # answered, and neither torch nor Lightning was imported
    assert "(default: " in done.stdout


def test_the_watch_cost_example_prints_its_figures(capsys):
    from examples.watch_cost import main

    figures = main(["--calls", "4", "--repeats", "1", "--depth", "2"])
    out = capsys.readouterr().out
    assert figures["tied block"]["calls"] == 4  # every call of the block was watched
    assert figures["tree linked"]["tensors"] == figures["tree"]["tensors"] == 13
    assert "us a call ours" in out
    assert "us the bare reads" in out  # the least this design can cost, timed beside it
    assert figures["tied block"]["floor"] > 0
    assert "us the essential watch" in out  # the least a watch that names the right module does
    assert figures["tied block"]["essential"] > 0
