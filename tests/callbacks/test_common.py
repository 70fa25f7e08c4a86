"""The callbacks' shared helpers: atomic report files, the write check, the umask, the cross-rank reductions."""

import json
import os
import tempfile

import pytest
import torch

from lightning_amp_plus.callbacks import _common
from tests.helpers.sharded import FakePeer


def test_reports_are_written_through_a_hidden_temporary_file_beside_the_target(tmp_path, monkeypatch):
    """Beside the target (a rename never crosses file systems) and hidden, so no reader sees half a file."""
    renames = []
    real_replace = os.replace

    def replace(src, dst):
        renames.append((src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "out" / "report.json"
    _common.write_json_atomically(target, {"a": [1, 2]})
    assert target.read_text() == '{\n  "a": [\n    1,\n    2\n  ]\n}'  # indent 2
    ((src, dst),) = renames
    assert dst == str(target)
    assert os.path.dirname(src) == str(tmp_path / "out")
    assert os.path.basename(src).startswith(".report.json.")
    assert src.endswith(".tmp")
    assert sorted(os.listdir(tmp_path / "out")) == ["report.json"]
    assert json.loads(target.read_text()) == {"a": [1, 2]}


def test_the_write_check_probes_the_reports_own_folder_and_leaves_nothing(tmp_path, monkeypatch):
    probes = []
    real = tempfile.NamedTemporaryFile

    def probe(*args, **kwargs):
        handle = real(*args, **kwargs)
        probes.append(handle.name)
        return handle

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", probe)
    _common.check_writable("NaNSkipReporter", "report_path", tmp_path / "deep" / "skips.json")
    (name,) = probes
    assert os.path.dirname(name) == str(tmp_path / "deep")
    assert os.path.basename(name).startswith(".write-check-")
    assert os.listdir(tmp_path / "deep") == []
    with pytest.raises(ValueError, match=r"`NaNSkipReporter\(report_path='.*'\)` is invalid: it is a folder"):
        _common.check_writable("NaNSkipReporter", "report_path", tmp_path)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc where it exists")
def test_the_umask_is_read_without_changing_the_process_umask(monkeypatch):
    """Setting and restoring the umask races with other threads creating files; /proc tells it without a change."""
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("the umask was changed"))
        assert _common._umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_report_file_gets_the_mode_the_umask_gives_any_new_file(tmp_path, mask):
    """mkstemp makes its file 0600: the report is set to what ``open()`` would have made, 0666 less the umask."""
    old = os.umask(mask)
    try:
        _common.write_text_atomically(tmp_path / "report.md", "x")
        with open(tmp_path / "plain.md", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    mode = os.stat(tmp_path / "report.md").st_mode & 0o777
    assert mode == 0o666 & ~mask
    assert mode == os.stat(tmp_path / "plain.md").st_mode & 0o777


def test_reductions_sum_or_take_the_max_over_the_ranks(monkeypatch):
    from lightning_amp_plus import _ranks

    peer = FakePeer(monkeypatch, lambda tensor, op: torch.tensor([5.0, 1.0]))
    assert _ranks.distributed()
    assert _ranks.all_reduce_(torch.tensor([1.0, 2.0])).tolist() == [6.0, 3.0]
    assert _ranks.all_reduce_(torch.tensor([1.0, 2.0]), op="max").tolist() == [5.0, 2.0]
    assert [c["op"] for c in peer.calls] == [torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX]
    with pytest.raises(KeyError):
        _ranks.all_reduce_(torch.tensor([1.0]), op="mean")
