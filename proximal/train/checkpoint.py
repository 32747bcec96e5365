"""Atomic writes: a checkpoint is either complete on disk or absent, never half-written.

Everything is written into a temporary sibling directory, fsynced, then renamed into place; a
crash mid-save leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on clean exit it replaces ``target`` in one rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for f in files:
                with open(os.path.join(root, f), "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
        os.rename(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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

