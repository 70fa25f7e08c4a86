"""What a newcomer meets first: the command line, the files the package writes, how its objects print."""

import os
import subprocess
import sys

import pytest
import torch

from lightning_amp_plus import DynamicLossScaler, NaNSkipReporter, NonFiniteChecker, ShardedDynamicLossScaler
from lightning_amp_plus.__about__ import __version__
from lightning_amp_plus.callbacks._common import write_json_atomically

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_version_and_help_import_neither_torch_nor_lightning():
    done = _run(
        "import sys\n"
        "from lightning_amp_plus.__main__ import main\n"
        "for argv in (['--version'], ['--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))\n"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"lightning-amp-plus {__version__}"
    assert "usage: lightning-amp-plus [-h] [--version] COMMAND ..." in done.stdout
    assert "``" not in done.stdout  # plain text, no reST markup
    assert lines[-1] == "[]"


def test_the_public_names_load_on_first_use():
    done = _run(
        "import sys, lightning_amp_plus as amp\n"
        "before = 'torch' in sys.modules\n"
        "amp.AmpPlusPrecision\n"
        "print(before, 'torch' in sys.modules, sorted(amp.__all__) == amp.__all__, 'NaNSkipReporter' in dir(amp))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "True"]
    import lightning_amp_plus

    assert lightning_amp_plus.__all__ == sorted([*lightning_amp_plus._EXPORTS, "__version__"])
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        lightning_amp_plus.Nope  # noqa: B018


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_report_files_get_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json_atomically(tmp_path / "skips.json", {"a": 1})
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "skips.json").st_mode & 0o777) == oct(mode)


def test_scalers_print_the_arguments_that_differ_from_the_defaults():
    assert repr(DynamicLossScaler("cpu", init_scale=1024.0, hysteresis=2)) == (
        "DynamicLossScaler(device='cpu', init_scale=1024.0, hysteresis=2)"
    )
    assert repr(ShardedDynamicLossScaler("cpu", growth_interval=5)) == (
        "ShardedDynamicLossScaler(device='cpu', growth_interval=5)"
    )
    scaler = DynamicLossScaler("cpu", growth_interval=7)
    scaler.set_growth_interval(9)
    resumed = DynamicLossScaler("cpu")
    resumed.load_state_dict(scaler.state_dict())
    assert repr(scaler) == repr(resumed) == "DynamicLossScaler(device='cpu', growth_interval=9)"  # the live knobs
    assert repr(NonFiniteChecker()) == "NonFiniteChecker()"
    assert repr(NonFiniteChecker(sharded=True)) == "NonFiniteChecker(sharded=True)"
    assert repr(NaNSkipReporter(max_warnings=1)) == "NaNSkipReporter(max_warnings=1)"
    assert torch.amp.GradScaler.__repr__ is object.__repr__  # ours is not torch's: the test means something


def test_the_package_is_typed():
    import lightning_amp_plus

    assert os.path.exists(os.path.join(os.path.dirname(lightning_amp_plus.__file__), "py.typed"))
