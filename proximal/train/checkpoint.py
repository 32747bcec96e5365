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
and every file has been hashed; ``checkpoints/latest`` (a one-line text file, the pointer resuming
reads) then names it. The loadable models are the exports: ``step_NNNNNN/policy``;
``checkpoints/newest``, a symbolic link to the newest checkpoint's first export (``from_pretrained``
opens it: ``--model.path runs/ppo/checkpoints/newest``); and, with ``output.keep_best``,
``checkpoints/best``, a symbolic link to the best checkpoint's export, which pruning never
deletes. The final model is exported into the run directory itself (:func:`export_final`). On resume the manifest is
checked file by file; a damaged checkpoint is reported (which file, how) and the newest intact one
is used instead. Temporary directories a killed run left behind are removed at the next start.

A save that fails — a full disk (ENOSPC, EDQUOT), any other ``OSError`` of the file system, on any
rank and at any point up to and including the update of ``latest`` — removes what it wrote, so the
previous checkpoint stays intact and still ``latest``, and raises :class:`SaveError` on every rank
alike: one line naming the path, and for a full disk the bytes the checkpoint needs.

Resuming reads the weights from ``state/`` into models built from the run's own config, so the
resumed run continues bitwise on CPU (and loads at a different number of processes, with DCP's
resharding, up to float32 round-off).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from proximal import dist
from proximal.models.parallel import export_pretrained

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint: the message names the directory and what is wrong with each candidate."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a file system error, on this process or another).

    What the save wrote is removed; the previous checkpoint is intact and still ``latest``. Every rank
    raises it with the same message, so rank 0 alone reports it (``everywhere``)."""

    everywhere = True


#: errno values of a file system that is out of space (or of the user's quota on it).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


# ----------------------------------------------------------------------------------------------
# Atomic files
# ----------------------------------------------------------------------------------------------


def _fsync_tree(root: Path) -> None:
    for parent, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(parent, f), "rb") as fh:
                os.fsync(fh.fileno())


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
    root: str | Path,
    step: int,
    *,
    trained: dict,
    state: dict,
    exports: dict,
    keep: int,
    meta: dict | None = None,
    best: int | None = None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` (every rank calls this); return its path.

    Args:
        trained: ``{name: (module, optimizer)}`` — weights and optimiser state, saved sharded (only
            trainable parameters: a LoRA run saves its adapters, not the frozen base weights).
        state: picklable trainer state (state dicts of schedules, samplers, controllers; counters),
            identical on every rank; rank 0 writes it.
        exports: ``{name: (module, tokenizer)}`` written as Hugging Face checkpoints ``<name>/``.
        keep: how many checkpoints to keep; older ones (by step) are deleted, never this one.
        meta: entries added to ``manifest.json`` (the command that wrote it).
        best: the step of the run's best checkpoint (``output.keep_best``; this one or an earlier
            one): never pruned, and ``root/best`` is made a symlink to its first export's directory
            (``step_NNNNNN/policy``), which ``from_pretrained`` opens.

    Raises:
        SaveError: on every rank, when a file could not be written on any rank (what was written is
            removed; the previous checkpoint stays ``latest``).
    """
    root = Path(root)
    final = root / step_name(step)
    tmp = root / f".{step_name(step)}.tmp"
    previous = _latest_name(root)
    try:
        # Each phase ends with every rank learning whether any failed (the barrier it needs anyway),
        # so all raise together and none waits in a collective the others have left.
        _agree(lambda: _fresh_dir(tmp / "rng") if dist.is_main() else None)
        ctx = _quiet_dcp()
        try:  # DCP agrees by itself: a write that fails on any rank raises on every rank
            dcp.save(_dcp_state(trained), checkpoint_id=str(tmp / "state"))
        finally:
            ctx.__exit__(None, None, None)
        for name, (module, tokenizer) in exports.items():  # each a collective (the full weights)
            _agree(lambda: export_pretrained(module, tokenizer, tmp / name, is_main=dist.is_main()))

        def own_files():
            torch.save(_rng_state(), tmp / "rng" / f"rank_{dist.rank():05d}.pt")
            if dist.is_main():
                torch.save(
                    {"step": step, "world_size": dist.world_size(), **state},
                    tmp / "trainer_state.pt",
                )

        _agree(own_files)
        hashes = _hash_shared(tmp, _files(tmp))
        manifest = {"step": step, "world_size": dist.world_size(), **(meta or {}), "files": hashes}
        first = f"/{next(iter(exports))}" if exports else ""
        best_dir = None if best is None else step_name(best) + first
        newest_dir = final.name + first if exports else None
        _agree(
            lambda: (
                _publish(root, tmp, final, manifest, keep, best_dir, newest_dir)
                if dist.is_main()
                else None
            )
        )
    except BaseException as e:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        error = _save_error(e, final, previous, root, trained, exports)
        if error is None:
            raise
        raise error from e
    return final


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path.parent, ignore_errors=True)
    path.mkdir(parents=True)


def _publish(
    root: Path,
    tmp: Path,
    final: Path,
    manifest: dict,
    keep: int,
    best_dir: str | None = None,
    newest_dir: str | None = None,
) -> None:
    """Rank 0: the manifest, the rename into place, ``newest``, ``latest``, ``best``, then the older
    checkpoints pruned. A ``newest`` or ``latest`` that cannot be written takes the renamed
    checkpoint back out (and ``newest`` back to where it pointed), so the one ``latest`` names is
    still the one to resume. ``best_dir``: ``step_NNNNNN/<model>`` of the best checkpoint, kept
    whatever its age; ``newest_dir``: ``step_NNNNNN/<model>`` of this one (None: nothing exported)."""
    atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _replace_dir(tmp, final)
    newest = root / "newest"
    before = os.readlink(newest) if newest.is_symlink() else None
    try:
        if newest_dir is not None:
            symlink(newest, newest_dir)
        atomic_write_text(root / "latest", final.name + "\n")
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        with contextlib.suppress(OSError):
            if before is not None:
                symlink(newest, before)
            elif newest.is_symlink():
                os.unlink(newest)
        raise
    kept = {final}
    if best_dir is not None:
        kept.add(root / best_dir.split("/")[0])
        symlink(root / "best", best_dir)
    for old in completed(root)[:-keep]:
        # never the checkpoint just written (at worst the only intact one), nor the best
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def symlink(path: Path, target: str) -> None:
    """``path`` → ``target`` (relative to ``path``'s directory) as a symbolic link, replacing what
    was there in one rename: a reader sees the old link or the new one, never none. A run directory
    copied without its links (``cp -r``, ``shutil.copytree``) holds a plain copy of the linked model
    there instead: that copy is removed first (a rename cannot replace a directory)."""
    tmp = path.with_name(f".{path.name}.link-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    os.symlink(target, tmp)
    os.replace(tmp, path)


class _OtherRank(Exception):
    """What another rank's failure in a save phase looked like: ``(rank, text, errno, path)``."""


def _agree(fn) -> None:
    """Run ``fn`` on this rank, then learn whether any rank failed: the failing rank re-raises its
    error, the others raise :class:`_OtherRank` describing it (one process: ``fn`` alone)."""
    error = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, on this rank and as _OtherRank on the others
        error = e
    if not dist.is_distributed():
        if error is not None:
            raise error
        return
    os_error = _os_error(error) if error is not None else None
    seen = dist.all_gather_object(
        None
        if error is None
        else (
            f"{type(error).__name__}: {error}",
            getattr(os_error, "errno", None),
            getattr(os_error, "filename", None),
        )
    )
    if error is not None:
        raise error
    for rank, failure in enumerate(seen):
        if failure is not None:
            raise _OtherRank(rank, *failure)


def _os_error(e: BaseException) -> OSError | None:
    """The file-system error behind ``e``: itself, one DCP collected from a rank, or one another rank
    reported (as an OSError rebuilt from its errno and path)."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, _OtherRank):
        _, text, code, path = e.args
        return OSError(code, text, path) if code is not None else None
    if isinstance(e, dcp.api.CheckpointException):
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, OSError):
                return inner
    return None


def _save_error(
    e: BaseException,
    final: Path,
    previous: str | None,
    root: Path,
    trained: dict,
    exports: dict,
) -> SaveError | None:
    """The one-line :class:`SaveError` for a failed save, or None when ``e`` is not the file system's
    (a bug, an interrupt: re-raised as it is)."""
    os_error = _os_error(e)
    if os_error is None:
        if isinstance(e, _OtherRank):
            return SaveError(
                f"checkpoint {final} was not written: process {e.args[0]} failed while writing it "
                f"({e.args[1][:300]}); {_kept(previous)}"
            )
        return None
    path = os_error.filename or final
    if os_error.errno in DISK_FULL:
        need = _previous_bytes(root, previous) or estimate_bytes(trained, exports)
        free = shutil.disk_usage(_existing(root)).free
        return SaveError(
            f"no space left on device for checkpoint {final} (writing {path}): it needs about "
            f"{_amount(need)} and {_amount(free)} are free there; the half-written checkpoint was "
            f"removed; {_kept(previous)}"
        )
    reason = os_error.strerror or str(os_error)
    return SaveError(f"cannot write checkpoint {final} ({reason}: {path}); {_kept(previous)}")


def _kept(previous: str | None) -> str:
    if previous is None:
        return "there is no earlier checkpoint"
    return f"{previous} is intact and still latest"


def _latest_name(root: Path) -> str | None:
    pointer = root / "latest"
    try:
        return pointer.read_text().strip() or None
    except OSError:
        return None


def _previous_bytes(root: Path, name: str | None) -> int | None:
    """The size of checkpoint ``name`` from its manifest (the next one is about as large)."""
    if name is None:
        return None
    try:
        files = json.loads((root / name / MANIFEST).read_text())["files"]
        return sum(int(f["bytes"]) for f in files.values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def estimate_bytes(trained: dict, exports: dict) -> int:
    """About how many bytes a checkpoint of these models takes: the trained parameters and their
    optimiser states (global sizes, however they are sharded), plus each export's whole state dict."""
    n = 0
    for module, optimizer in trained.values():
        # DCP stores by name: tied weights (an embedding shared with the head) count once per name
        for _, p in module.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                state = optimizer.state.get(p, {})
                n += _bytes(p) + sum(_bytes(t) for t in state.values() if torch.is_tensor(t))
    for module, _ in exports.values():
        # safetensors stores shared tensors once
        seen = {t.data_ptr(): _bytes(t) for t in module.state_dict().values()}
        n += sum(seen.values())
    return n


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _amount(n: int) -> str:
    """``12.3 GiB (13207024435 bytes)``; below a KiB just the bytes."""
    if n < 1024:
        return f"{n} bytes"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        x /= 1024
        if x < 1024 or unit == "TiB":
            break
    return f"{x:.1f} {unit} ({n} bytes)"


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
    """Checkpoint directories under ``root``, oldest first by step (``step_1000000`` after
    ``step_999999``; temporary ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


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

    Written into ``run_dir/.export.tmp`` first, then each file renamed into place. Every rank calls it;
    a file system error on any rank (a full disk) removes the temporary directory and raises
    :class:`SaveError` on every rank (the last checkpoint's ``<name>/`` holds the same model).
    """
    run_dir = Path(run_dir)
    tmp = run_dir / ".export.tmp"

    def write():
        export_pretrained(module, tokenizer, tmp, is_main=dist.is_main())
        if dist.is_main():
            _fsync_tree(tmp)

    try:
        _agree(lambda: shutil.rmtree(tmp, ignore_errors=True) if dist.is_main() else None)
        _agree(write)
    except BaseException as e:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        error = _os_error(e)
        if error is None:
            raise
        raise SaveError(
            f"cannot write the trained model into {run_dir} ({error.strerror or error}: "
            f"{error.filename or tmp}); the last checkpoint under {run_dir / 'checkpoints'} holds it"
        ) from e
    if dist.is_main():
        for f in sorted(tmp.iterdir()):
            os.replace(f, run_dir / f.name)
        tmp.rmdir()
    dist.barrier()
