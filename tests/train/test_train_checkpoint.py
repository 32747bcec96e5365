"""Checkpoints in one process (``proximal.train.checkpoint``): atomic files and directories, what a
checkpoint holds and its manifest, an exact round trip (weights, optimiser state, trainer state,
random generators), how many are kept, how damage is detected and which checkpoint a resume picks,
and the final Hugging Face export.

The models are a ``Linear`` with one frozen parameter (a LoRA run's frozen base, in miniature).
Several processes and resharding: tests/distributed/test_resume_and_failures.py; damage to each
file of a real PPO checkpoint: tests/test_bad_input.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm
from proximal.train.checkpoint import (
    MANIFEST,
    CheckpointError,
    atomic_write_text,
    completed,
    export_final,
    find_checkpoint,
    load_checkpoint,
    remove_leftovers,
    save_checkpoint,
    step_name,
    verify,
)
from proximal.train.optim import build_optimizer


def _model(seed: int, inputs: int = 3):
    torch.manual_seed(seed)
    m = torch.nn.Linear(inputs, 2)
    m.frozen = torch.nn.Parameter(torch.full((2,), float(seed)), requires_grad=False)
    return m, build_optimizer(m, lr=0.1, weight_decay=0.01)


def _step(m, opt) -> None:
    m(torch.arange(3.0).reshape(1, 3)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _save(root, step: int, m, opt, keep: int = 5, **state):
    return save_checkpoint(
        root, step, trained={"policy": (m, opt)}, state=state, exports={}, keep=keep
    )


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def three(tmp_path):
    """Checkpoints of steps 1, 2 and 3 under ``tmp_path / "checkpoints"``."""
    m, opt = _model(0)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _step(m, opt)
        _save(root, step, m, opt)
    return root


# ----------------------------------------------------------------------------------------------
# Atomic files and directories
# ----------------------------------------------------------------------------------------------


def test_atomic_write_text_writes_and_replaces_leaving_nothing_else(tmp_path):
    f = tmp_path / "sub" / "latest"
    atomic_write_text(f, "step_000001\n")
    atomic_write_text(f, "step_000002\n")
    assert f.read_text() == "step_000002\n"
    assert [p.name for p in f.parent.iterdir()] == ["latest"]


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path):
    f = tmp_path / "latest"
    atomic_write_text(f, "old\n")
    with pytest.raises(TypeError):
        atomic_write_text(f, b"not text")  # fails inside the write
    assert f.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


# ----------------------------------------------------------------------------------------------
# Saving: the layout and the manifest
# ----------------------------------------------------------------------------------------------


def test_step_names_sort_as_steps():
    assert step_name(7) == "step_000007" and step_name(1234567) == "step_1234567"
    assert sorted([step_name(10), step_name(9)]) == [step_name(9), step_name(10)]


def test_a_checkpoint_lists_every_file_with_its_size_and_hash(tmp_path):
    m, opt = _model(0)
    _step(m, opt)
    path = _save(tmp_path, 7, m, opt, sampler={"epoch": 1, "position": 3})
    assert path == tmp_path / "step_000007"
    assert (tmp_path / "latest").read_text() == "step_000007\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000007"]  # no temp dir
    files = sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST
    )
    assert {"trainer_state.pt", "rng/rank_00000.pt", "state/.metadata"} <= set(files)
    manifest = json.loads((path / MANIFEST).read_text())
    assert (manifest["step"], manifest["world_size"]) == (7, 1)
    assert sorted(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        assert entry == {"bytes": (path / name).stat().st_size, "sha256": _sha256(path / name)}
    assert verify(path) is None


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    m, opt = _model(0)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, m, opt, keep=2)
    assert completed(tmp_path) == [tmp_path / "step_000003", tmp_path / "step_000004"]
    assert (tmp_path / "latest").read_text() == "step_000004\n"


# ----------------------------------------------------------------------------------------------
# Loading: an exact round trip
# ----------------------------------------------------------------------------------------------


def test_load_restores_weights_optimiser_state_trainer_state_and_random_generators(tmp_path):
    m, opt = _model(0)
    _step(m, opt)
    _step(m, opt)
    path = _save(tmp_path, 2, m, opt, sampler={"epoch": 1, "position": 3}, counters={"wall_s": 2.5})
    after_save = torch.rand(4), random.random()  # what a run that never stopped draws next

    m2, opt2 = _model(1)  # built afresh for the resumed run: other weights, no optimiser state
    torch.manual_seed(99)
    random.seed(99)
    state = load_checkpoint(path, trained={"policy": (m2, opt2)})

    assert state == {
        "step": 2,
        "world_size": 1,
        "sampler": {"epoch": 1, "position": 3},
        "counters": {"wall_s": 2.5},
    }
    assert torch.equal(m2.weight, m.weight) and torch.equal(m2.bias, m.bias)
    assert torch.equal(m2.frozen, torch.full((2,), 1.0))  # frozen weights are not checkpointed
    saved, loaded = opt.state_dict(), opt2.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    for i, s in saved["state"].items():
        assert set(loaded["state"][i]) == set(s)
        assert all(torch.equal(loaded["state"][i][k], v) for k, v in s.items())
    assert torch.equal(torch.rand(4), after_save[0]) and random.random() == after_save[1]
    _step(m, opt)  # and the next step is the same step
    _step(m2, opt2)
    assert torch.equal(m2.weight, m.weight) and torch.equal(m2.bias, m.bias)


def test_a_checkpoint_that_does_not_fit_the_model_is_named(tmp_path):
    m, opt = _model(0)
    path = _save(tmp_path, 1, m, opt)
    other, other_opt = _model(0, inputs=4)
    with pytest.raises(CheckpointError, match="its weights do not fit the models being trained"):
        load_checkpoint(path, trained={"policy": (other, other_opt)})


# ----------------------------------------------------------------------------------------------
# Verifying and choosing a checkpoint
# ----------------------------------------------------------------------------------------------


def test_verify_names_each_kind_of_damage(three):
    path = three / "step_000003"
    assert verify(path) is None
    f = path / "trainer_state.pt"
    data = f.read_bytes()

    f.write_bytes(data[:-1])
    assert verify(path) == (
        f"{f} has {len(data) - 1} bytes, the manifest says {len(data)} (truncated or overwritten)"
    )
    f.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    assert verify(path) == f"{f} does not match its SHA-256 in the manifest (corrupt)"
    f.unlink()
    assert verify(path) == f"{f} is missing"
    (path / MANIFEST).write_text("{not json")
    assert verify(path).startswith(f"{path / MANIFEST} is unreadable")
    (path / MANIFEST).unlink()
    assert verify(path).startswith(f"{path / MANIFEST} is missing (the checkpoint was never")


def test_the_newest_intact_checkpoint_is_found(three):
    assert find_checkpoint(three) == (three / "step_000003", [])


def test_the_checkpoint_latest_names_comes_first(three):
    (three / "latest").write_text("step_000002\n")
    assert find_checkpoint(three) == (three / "step_000002", [])


def test_a_damaged_checkpoint_is_skipped_for_the_next_intact_one(three):
    (three / "step_000003" / "rng" / "rank_00000.pt").unlink()
    found, notes = find_checkpoint(three)
    assert found == three / "step_000002"
    assert notes == [
        f"skipping checkpoint step_000003: {three / 'step_000003' / 'rng' / 'rank_00000.pt'} is "
        "missing",
        "resuming from step_000002, the newest intact checkpoint",
    ]


def test_an_interrupted_save_is_removed_and_reported(three):
    (three / ".step_000004.tmp" / "state").mkdir(parents=True)
    found, notes = find_checkpoint(three)
    assert found == three / "step_000003"
    assert notes == [
        "removed 1 incomplete checkpoint(s) left by an interrupted save: .step_000004.tmp"
    ]
    assert not (three / ".step_000004.tmp").exists()


def test_no_intact_checkpoint(three, tmp_path):
    for c in completed(three):
        (c / MANIFEST).unlink()
    found, notes = find_checkpoint(three)
    assert found is None
    assert [n.split(":")[0] for n in notes] == [
        "skipping checkpoint step_000003",
        "skipping checkpoint step_000002",
        "skipping checkpoint step_000001",
    ]
    assert find_checkpoint(tmp_path / "never_written") == (None, [])


def test_completed_and_leftovers_tell_checkpoints_from_the_rest(tmp_path):
    for name in ("step_000010", "step_000002", ".step_000011.tmp", ".step_000012.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_000099").write_text("a file, not a checkpoint")
    (tmp_path / ".step_notes").write_text("a file, not a temporary checkpoint")
    (tmp_path / "latest").write_text("step_000010\n")
    assert completed(tmp_path) == [tmp_path / "step_000002", tmp_path / "step_000010"]
    assert remove_leftovers(tmp_path) == [".step_000011.tmp", ".step_000012.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".step_notes",
        "latest",
        "step_000002",
        "step_000010",
        "step_000099",
    ]
    assert completed(tmp_path / "missing") == [] and remove_leftovers(tmp_path / "missing") == []


# ----------------------------------------------------------------------------------------------
# The final export
# ----------------------------------------------------------------------------------------------


def test_export_final_makes_the_run_directory_a_model_directory(tmp_path):
    tok = build_char_tokenizer(list("ab "))
    model = AutoModelForCausalLM.from_pretrained(build_tiny_causal_lm(tmp_path / "src", tok))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    export_final(run, model, tok)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the run's own files stay
    assert not (run / ".export.tmp").exists()
    back = AutoModelForCausalLM.from_pretrained(run)
    assert all(
        torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values())
    )
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in run.iterdir()}


def test_newest_is_a_model_directory_that_follows_each_save(tmp_path):
    """``checkpoints/newest`` links to the newest checkpoint's first export: ``from_pretrained``
    opens it and gets that step's weights, and it moves on (past pruning) with every save."""
    tok = build_char_tokenizer(list("ab "))
    model = AutoModelForCausalLM.from_pretrained(build_tiny_causal_lm(tmp_path / "src", tok))
    opt = build_optimizer(model, lr=0.1, weight_decay=0.0)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        opt.step()
        opt.zero_grad()
        save_checkpoint(
            root,
            step,
            trained={"policy": (model, opt)},
            state={},
            exports={"policy": (model, tok), "critic": (model, tok)},
            keep=2,
        )
        assert (root / "newest").is_symlink()
        assert (root / "newest").resolve() == (root / step_name(step) / "policy").resolve()
        back = AutoModelForCausalLM.from_pretrained(root / "newest")
        assert all(
            torch.equal(a, b)
            for a, b in zip(back.state_dict().values(), model.state_dict().values())
        )
    assert sorted(p.name for p in root.iterdir()) == [
        "latest",
        "newest",
        step_name(2),
        step_name(3),
    ]


def test_without_an_export_there_is_no_newest(three):
    assert not (three / "newest").exists()


def test_a_copied_run_whose_links_became_directories_saves_again(tmp_path):
    """``shutil.copytree`` (like ``cp -r``) copies ``newest`` as a plain directory: the next save
    replaces it with a link again instead of failing on a rename over a directory."""
    tok = build_char_tokenizer(list("ab "))
    model = AutoModelForCausalLM.from_pretrained(build_tiny_causal_lm(tmp_path / "src", tok))
    opt = build_optimizer(model, lr=0.1, weight_decay=0.0)

    def save(root, step):
        save_checkpoint(
            root,
            step,
            trained={"policy": (model, opt)},
            state={},
            exports={"policy": (model, tok)},
            keep=2,
        )

    save(tmp_path / "a" / "checkpoints", 1)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copied = tmp_path / "b" / "checkpoints" / "newest"
    assert copied.is_dir() and not copied.is_symlink()
    save(tmp_path / "b" / "checkpoints", 2)
    assert copied.is_symlink() and os.readlink(copied) == "step_000002/policy"
    assert sorted(p.name for p in copied.parent.iterdir()) == [
        "latest",
        "newest",
        "step_000001",
        "step_000002",
    ]
