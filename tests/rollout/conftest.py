"""Fixtures of the rollout tests."""

from __future__ import annotations

import pytest

from proximal.models import kernels
from proximal.rollout import decode


@pytest.fixture
def cpu_matmul(monkeypatch):
    """``cpu_matmul("onednn" | "blas" | "auto")`` sets this process's float32 CPU backend
    (:func:`proximal.models.kernels.configure`) for one test, ``PROXIMAL_CPU_MATMUL`` unset; the
    backend and the operators it found come back afterwards."""
    monkeypatch.delenv(kernels.ENV, raising=False)
    for name in ("_BACKEND", "_OP", "_REORDER"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    return kernels.configure


@pytest.fixture
def lean_steps(monkeypatch) -> list[int]:
    """How many lean decode steps ran: ``[n]``."""
    n = [0]
    step = decode.LeanDecoder.step

    def counted(self, *a):
        n[0] += 1
        return step(self, *a)

    monkeypatch.setattr(decode.LeanDecoder, "step", counted)
    return n
