"""Full disks and unwritable directories. A checkpoint save that meets ENOSPC — in the sharded
weights and optimiser state, the Hugging Face export, a rank's RNG file, the trainer state, the
manifest, the rename into place or the update of ``latest`` — ends with one line naming the path
and the bytes the checkpoint needs, removes what it wrote, and leaves the previous checkpoint intact
and ``latest`` (exit status 1 through the command line, and ``--resume auto`` continues from it).
An output directory that cannot be written is refused before any model loads (exit status 2)."""

from __future__ import annotations

import contextlib
import errno
import os
import re

import pytest
import torch
from resume_support import (  # noqa: F401
    assert_same_weights,
    fixed_argv,
    measured_out,
    metrics,
    one_thread,
    write_rows,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

import proximal.train.checkpoint as ckpt_mod
from proximal.cli import main
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm
from proximal.train.checkpoint import (
    MANIFEST,
    SaveError,
    completed,
    save_checkpoint,
    verify,
)
from proximal.train.optim import build_optimizer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_causal_lm(
        tmp_path_factory.mktemp("disk") / "base", build_char_tokenizer("abcdefgh="), seed=0
    )


def enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _fail_dcp_write(monkeypatch):
    """DCP's own file writer runs out of space after 10 bytes of the shard file: the failure
    surfaces as DCP reports it (a CheckpointException collected from the ranks)."""
    from torch.distributed.checkpoint import filesystem

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with open(path, mode) as fh:
            if str(path).endswith(".distcp"):
                fh.write(b"\0" * 10)
                raise enospc(path)
            yield fh

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)


def _fail_export(monkeypatch):
    def export(module, tokenizer, directory, **kw):
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"\0" * 10)  # half a file
        raise enospc(directory / "model.safetensors")

    monkeypatch.setattr(ckpt_mod, "export_pretrained", export)


def _fail_torch_save(part: str):
    def install(monkeypatch):
        save = torch.save

        def failing(obj, f, *a, **k):
            if part in str(f):
                raise enospc(f)
            return save(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", failing)

    return install


def _fail_text(name: str):
    def install(monkeypatch):
        write = ckpt_mod.atomic_write_text

        def failing(path, text):
            if os.path.basename(path) == name:
                raise enospc(path)
            return write(path, text)

        monkeypatch.setattr(ckpt_mod, "atomic_write_text", failing)

    return install


def _fail_rename(monkeypatch):
    def failing(src, target):
        raise enospc(target)

    monkeypatch.setattr(ckpt_mod, "_replace_dir", failing)


def _fail_newest(monkeypatch):
    link = ckpt_mod.symlink

    def failing(path, target):
        if os.path.basename(path) == "newest":
            raise enospc(path)
        return link(path, target)

    monkeypatch.setattr(ckpt_mod, "symlink", failing)


POINTS = {
    "weights and optimiser (DCP)": _fail_dcp_write,
    "Hugging Face export": _fail_export,
    "RNG file": _fail_torch_save("rng/rank_"),
    "trainer state": _fail_torch_save("trainer_state.pt"),
    "manifest": _fail_text(MANIFEST),
    "rename into place": _fail_rename,
    "newest": _fail_newest,
    "latest": _fail_text("latest"),
}


@pytest.fixture(scope="module")
def model(base):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(base)
    return m, build_optimizer(m, lr=0.1, weight_decay=0.0), AutoTokenizer.from_pretrained(base)


def _save(root, step, model):
    m, opt, tok = model
    m(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    opt.zero_grad()
    return save_checkpoint(
        root,
        step,
        trained={"model": (m, opt)},
        state={"counters": {}},
        exports={"model": (m, tok)},
        keep=2,
    )


@pytest.mark.parametrize("point", list(POINTS))
def test_a_full_disk_anywhere_in_a_save_keeps_the_previous_checkpoint(
    point, model, tmp_path, monkeypatch
):
    root = tmp_path / "checkpoints"
    first = _save(root, 1, model)
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file() and p.name != MANIFEST)
    with monkeypatch.context() as mp:
        POINTS[point](mp)
        with pytest.raises(SaveError) as caught:
            _save(root, 2, model)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on device for checkpoint {root / 'step_000002'}")
    assert f"it needs about {size / 1024:.1f} KiB ({size} bytes)" in message  # step 1's size
    assert re.search(r"writing \S+", message)  # the path that failed
    assert message.endswith(
        "the half-written checkpoint was removed; step_000001 is intact and still latest"
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "newest", "step_000001"]
    assert (root / "latest").read_text() == "step_000001\n"
    assert os.readlink(root / "newest") == "step_000001/model"  # put back where it pointed
    assert verify(first) is None


def test_without_an_earlier_checkpoint_the_bytes_needed_are_estimated(model, tmp_path, monkeypatch):
    with monkeypatch.context() as mp:
        _fail_export(mp)
        with pytest.raises(SaveError, match="there is no earlier checkpoint") as caught:
            _save(tmp_path / "checkpoints", 1, model)
    need = int(re.search(r"\((\d+) bytes\)", str(caught.value)).group(1))
    m, opt, _ = model
    params = list(m.parameters())  # AdamW: the weights, two moments and a step count each
    weights = sum(p.numel() * 4 for p in params)
    assert need == 3 * weights + 4 * len(params) + weights  # + the export's float32 weights
    written = _save(tmp_path / "again", 1, model)
    actual = sum(p.stat().st_size for p in written.rglob("*") if p.is_file())
    assert 0.7 * actual < need <= actual  # DCP's per-tensor records and small files on top


def test_keep_checkpoints_orders_by_step_and_never_prunes_the_newest(model, tmp_path):
    root = tmp_path / "checkpoints"
    for step in (999_999, 1_000_000, 1_000_001):  # names that sort wrongly as text
        _save(root, step, model)
    assert [p.name for p in completed(root)] == ["step_1000000", "step_1000001"]


def test_a_full_disk_through_the_command_line(base, tmp_path, monkeypatch, capsys):
    """Exit status 1 with the one line; the previous checkpoint is where --resume auto continues,
    to the uninterrupted run's metrics and weights."""
    data = write_rows("sft", tmp_path / "d.jsonl", 16)
    full, run = tmp_path / "full", tmp_path / "run"
    assert main(fixed_argv("sft", base, data, full, save_every=2)) == 0
    argv = fixed_argv("sft", base, data, run, "--resume", "auto", save_every=2)
    capsys.readouterr()
    with monkeypatch.context() as mp:
        _fail_torch_save("step_000004.tmp/trainer_state.pt")(mp)
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"proximal sft: no space left on device for checkpoint {run / 'checkpoints'}" in err
    assert "step_000002 is intact and still latest" in err
    assert (run / "checkpoints" / "latest").read_text() == "step_000002\n"
    assert main(argv) == 0, capsys.readouterr().err
    assert measured_out(metrics(run)) == measured_out(metrics(full))
    assert_same_weights(full, run)


def test_a_full_disk_outside_a_save_is_one_line_too(base, tmp_path, monkeypatch, capsys):
    from proximal import logging as plog

    argv = fixed_argv("sft", base, write_rows("sft", tmp_path / "d.jsonl", 16), tmp_path / "run")
    log = plog.MetricsLogger.log

    def full(self, step, row):
        if step == 2:
            raise enospc(tmp_path / "run" / "metrics.jsonl")
        return log(self, step, row)

    monkeypatch.setattr(plog.MetricsLogger, "log", full)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"proximal sft: No space left on device: {tmp_path / 'run' / 'metrics.jsonl'}\n"


def test_an_unwritable_output_dir_is_refused_before_the_model_loads(
    base, tmp_path, monkeypatch, capsys
):
    from proximal.trainers import sft

    monkeypatch.setattr(sft, "load_causal_lm", lambda *a, **k: pytest.fail("the model loaded"))
    data = write_rows("sft", tmp_path / "d.jsonl", 16)
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    target = blocker / "run"
    assert main(fixed_argv("sft", base, data, target)) == 2
    assert capsys.readouterr().err == (
        f"proximal sft: output.dir = {target}: cannot write there (Not a directory: {target})\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "file"]


def test_a_read_only_output_dir_is_refused(base, tmp_path, monkeypatch, capsys):
    from proximal.trainers import sft

    monkeypatch.setattr(sft, "load_causal_lm", lambda *a, **k: pytest.fail("the model loaded"))
    data = write_rows("sft", tmp_path / "d.jsonl", 16)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions do not stop writing")
        assert main(fixed_argv("sft", base, data, locked / "run")) == 2
        assert capsys.readouterr().err == (
            f"proximal sft: output.dir = {locked / 'run'}: cannot write there "
            f"(Permission denied: {locked / 'run'})\n"
        )
    finally:
        locked.chmod(0o700)
    assert not any(locked.iterdir())
