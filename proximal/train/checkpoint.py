"""Checkpoints: complete on disk or absent, verified before use, resumed exactly, on any number of
processes.

A checkpoint is a directory ``checkpoints/step_NNNNNN/``::

    state/              torch.distributed.checkpoint (DCP): trained weights and optimiser states,
                        sharded as they live in memory (each rank writes its own shards)
    trainer_state.pt    everything else that moves: schedules, samplers, KL controller, counters
    rng/rank_R.pt       each rank's random-number generators
    <name>/             a plain Hugging Face export of each trained model (``save_pretrained``,
                        safetensors + tokenizer) that loads on one device — policy/, critic/, model/
    manifest.json       every file above with its size and SHA-256, written last

It is written into ``.step_NNNNNN.tmp`` and renamed into place only when every rank has written
and every file has been hashed; ``checkpoints/latest`` then names it. On resume the manifest is
checked file by file; a damaged checkpoint is reported (which file, how) and the newest intact one
is used instead. Temporary directories a killed run left behind are removed at the next start.

Resuming reads the weights from ``state/`` into models built from the run's own config, so the
resumed run continues bitwise on CPU (and loads at a different number of processes, with DCP's
resharding, up to float32 round-off).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from proximal import dist
from proximal.models.parallel import export_pretrained

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint: the message names the directory and what is wrong with each candidate."""


# ----------------------------------------------------------------------------------------------
# Atomic files
# ----------------------------------------------------------------------------------------------


def _fsync_tree(root: Path) -> None:
    for parent, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(parent, f), "rb") as fh:
                os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory (one process); on clean exit it replaces ``target`` in one rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(src: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    os.rename(src, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _hash_shared(root: Path, names: list[str]) -> dict[str, dict]:
    """fsync, size and SHA-256 of ``names`` under ``root``, the work split over ranks (file i on rank
    i mod W), merged on every rank."""
    mine = {}
    for n in names[dist.rank() :: dist.world_size()]:
        with open(root / n, "rb") as fh:
            os.fsync(fh.fileno())
        mine[n] = {"bytes": (root / n).stat().st_size, "sha256": _sha256(root / n)}
    merged: dict[str, dict] = {}
    for part in dist.all_gather_object(mine):
        merged.update(part)
    return merged


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _dcp_state(trained: dict) -> dict:
    out = {}
    for name, (module, optimizer) in trained.items():
        msd, osd = get_state_dict(
            module, optimizer, options=StateDictOptions(ignore_frozen_params=True)
        )
        out[name] = {"model": msd, "optim": osd}
    return out


def _quiet_dcp():
    """DCP warns that it assumes one process when no process group exists; that is the intent."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    return ctx


def save_checkpoint(
    root: str | Path, step: int, *, trained: dict, state: dict, exports: dict, keep: int
) -> Path:
    """Write checkpoint ``step`` under ``root`` (every rank calls this); return its path.

    Args:
        trained: ``{name: (module, optimizer)}`` — weights and optimiser state, saved sharded (only
            trainable parameters: a LoRA run saves its adapters, not the frozen base weights).
        state: picklable trainer state (state dicts of schedules, samplers, controllers; counters),
            identical on every rank; rank 0 writes it.
        exports: ``{name: (module, tokenizer)}`` written as Hugging Face checkpoints ``<name>/``.
        keep: how many checkpoints to keep; older ones are deleted.
    """
    root = Path(root)
    final = root / step_name(step)
    tmp = root / f".{step_name(step)}.tmp"
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    ctx = _quiet_dcp()
    try:
        dcp.save(_dcp_state(trained), checkpoint_id=str(tmp / "state"))
    finally:
        ctx.__exit__(None, None, None)
    for name, (module, tokenizer) in exports.items():
        export_pretrained(module, tokenizer, tmp / name, is_main=dist.is_main())
    torch.save(_rng_state(), tmp / "rng" / f"rank_{dist.rank():05d}.pt")
    if dist.is_main():
        torch.save(
            {"step": step, "world_size": dist.world_size(), **state}, tmp / "trainer_state.pt"
        )
    dist.barrier()
    names = _files(tmp)
    hashes = _hash_shared(tmp, names)
    if dist.is_main():
        manifest = {"step": step, "world_size": dist.world_size(), "files": hashes}
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        _replace_dir(tmp, final)
        atomic_write_text(root / "latest", step_name(step) + "\n")
        for old in completed(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


# ----------------------------------------------------------------------------------------------
# Finding, verifying and loading
# ----------------------------------------------------------------------------------------------


def completed(root: str | Path) -> list[Path]:
    """Checkpoint directories under ``root``, oldest first (temporary ones excluded)."""
    root = Path(root)
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def remove_leftovers(root: str | Path) -> list[str]:
    """Delete temporary checkpoint directories a killed run left behind (rank 0); return their names."""
    root = Path(root)
    if not root.is_dir():
        return []
    left = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(".step_"))
    if dist.is_main():
        for p in left:
            shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in left]


def verify(path: Path) -> str | None:
    """None if every file of the manifest is there with its size and hash; else what is wrong."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (the checkpoint was never completed, or was written by an older proximal)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{manifest} is unreadable ({e})"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{f} has {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
        if _sha256(f) != want["sha256"]:
            return f"{f} does not match its SHA-256 in the manifest (corrupt)"
    return None


def find_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint under ``root`` and messages about what was skipped on the way.

    Candidates: the one ``latest`` names, then every other, newest first. Rank 0 verifies and tells
    the others, so all ranks resume from the same one.
    """
    root = Path(root)

    def choose():
        notes = []
        left = remove_leftovers(root)
        if left:
            notes.append(
                f"removed {len(left)} incomplete checkpoint(s) left by an interrupted save: {', '.join(left)}"
            )
        candidates = completed(root)[::-1]
        pointer = root / "latest"
        if pointer.is_file():
            named = root / pointer.read_text().strip()
            if named in candidates:
                candidates.remove(named)
                candidates.insert(0, named)
        for c in candidates:
            problem = verify(c)
            if problem is None:
                return str(c), notes
            notes.append(f"skipping checkpoint {c.name}: {problem}")
        return None, notes

    found, notes = dist.broadcast_object(choose() if dist.is_main() else None)
    if found is not None and notes and any(n.startswith("skipping") for n in notes):
        notes.append(f"resuming from {Path(found).name}, the newest intact checkpoint")
    return (Path(found) if found is not None else None), notes


def load_checkpoint(path: Path, *, trained: dict) -> dict:
    """Load weights and optimiser states into ``trained`` (``{name: (module, optimizer)}``, built as
    for a fresh run) and this rank's RNGs; return the trainer state saved with them."""
    target = _dcp_state(trained)
    ctx = _quiet_dcp()
    try:
        dcp.load(target, checkpoint_id=str(path / "state"))
    except (RuntimeError, dcp.api.CheckpointException) as e:  # CheckpointException: a BaseException
        first = next(
            (
                line
                for line in str(e).splitlines()
                if "Missing key" in line or "ize mismatch" in line
            ),
            None,
        )
        if first is None:
            raise
        raise CheckpointError(
            f"checkpoint {path}: its weights do not fit the models being trained "
            f"({first.strip()[:300]}); resume with the run's own model settings"
        ) from None
    finally:
        ctx.__exit__(None, None, None)
    for name, (module, optimizer) in trained.items():
        set_state_dict(
            module,
            optimizer,
            model_state_dict=target[name]["model"],
            optim_state_dict=target[name]["optim"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    rng_file = path / "rng" / f"rank_{dist.rank():05d}.pt"
    if rng_file.is_file() and state.get("world_size") == dist.world_size():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def export_final(run_dir: str | Path, module: torch.nn.Module, tokenizer) -> None:
    """The trained model as a plain Hugging Face checkpoint in ``run_dir`` itself (``proximal sft``
    and ``proximal rm`` runs are model directories: point the next stage's ``model.path`` at them).

    Written into ``run_dir/.export.tmp`` first, then each file renamed into place. Every rank calls it.
    """
    run_dir = Path(run_dir)
    tmp = run_dir / ".export.tmp"
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    export_pretrained(module, tokenizer, tmp, is_main=dist.is_main())
    if dist.is_main():
        _fsync_tree(tmp)
        for f in sorted(tmp.iterdir()):
            os.replace(f, run_dir / f.name)
        tmp.rmdir()
    dist.barrier()
