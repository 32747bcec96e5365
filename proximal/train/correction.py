"""What PPO and GRPO share about the rollout mismatch (docs/rollout-correction.md): the per-step
``rollout/*`` metrics of μ (the engine's log-probabilities) against π_old (the trainer's), and where
π_old comes from when the experience holds none.

The math is :mod:`proximal.core.correction`'s; this module only names the metrics and gathers the
tensors they read. π_old is in the experience when it was computed there. It is not in two cases —
GRPO's one optimiser step per batch (π_old is the update's own forward, detached) and
``rollout.correction: bypass`` (π_old := μ, no forward) — and then the update's forward before its
first optimiser step is π_old on the rows it covers: :class:`FirstStepLogprobs` keeps those rows.
"""

from __future__ import annotations

import math

import torch

from proximal import dist
from proximal.core.correction import (
    DEFAULT_TOKEN_BAND,
    correction_weights,
    mismatch_stats,
)

#: ``mismatch_stats`` key → metric name.
_MISMATCH = {
    "mismatch_k1": "rollout/mismatch_k1",
    "mismatch_k3": "rollout/mismatch_k3",
    "ratio_max": "rollout/ratio_max",
    "ratio_min": "rollout/ratio_min",
    "ratio_p99": "rollout/ratio_p99",
    "outside_band_frac": "rollout/outside_band_frac",
}


def metric_band(mode: str, band: list[float] | None) -> tuple[float, float]:
    """The band of ``rollout/outside_band_frac``: ``rollout.correction_band`` where it is a token
    band (any mode but seq_mask, whose band bounds a response's geometric mean), else IcePop's
    :data:`~proximal.core.correction.DEFAULT_TOKEN_BAND`."""
    if band is not None and mode != "seq_mask":
        return (float(band[0]), float(band[1]))
    return DEFAULT_TOKEN_BAND


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    mode: str,
    cap: float,
    band: list[float] | None,
    every_mode: bool = False,
) -> dict[str, float]:
    """The step's ``rollout/*`` metrics over the tokens of ``mask`` (B, T) — the whole batch, every
    rank holding it: μ against π_old (:func:`~proximal.core.correction.mismatch_stats`:
    ``mismatch_k1``, ``mismatch_k3``, ``ratio_max``, ``ratio_min``, ``ratio_p99``,
    ``outside_band_frac``), and what ``mode`` did with them
    (:func:`~proximal.core.correction.correction_weights`' stats as ``rollout/correction_*``:
    ``weight_mean`` and ``truncated_frac``, ``masked_frac`` or ``masked_seq_frac``). With
    ``every_mode`` (``rollout.staleness`` ≥ 1, where μ is an older policy's) also what each of the
    correction modes would do to these tokens, whichever is set: ``rollout/tis_truncated_frac``,
    ``rollout/token_mask_masked_frac`` and ``rollout/seq_mask_masked_seq_frac`` (their own default
    bands unless ``band`` is given). An engine that gave no log-probabilities (``behaviour_logprobs``
    None) gets NaN for the first six."""
    if behaviour_logprobs is None:
        return dict.fromkeys(_MISMATCH.values(), math.nan)
    st = mismatch_stats(old_logprobs, behaviour_logprobs, mask, band=metric_band(mode, band))
    out = {name: float(st[key]) for key, name in _MISMATCH.items()}
    if int(mask.sum()) > 0:

        def stats(m: str) -> dict:  # what mode m does to these tokens
            kept = None if band is None else tuple(band)
            return correction_weights(
                m, old_logprobs, behaviour_logprobs, mask, cap=cap, band=kept
            )[1]

        out.update({f"rollout/correction_{k}": float(v) for k, v in stats(mode).items()})
        for other in ("tis", "token_mask", "seq_mask") if every_mode else ():
            would = stats(other)
            out.update(
                {f"rollout/{other}_{k}": float(v) for k, v in would.items() if k != "weight_mean"}
            )
    return out


class FirstStepLogprobs:
    """The update forward's log-probabilities of each row it passes before the first optimiser step
    (so under π_old), written row by row into a (B, T) buffer; :meth:`gathered` sums the ranks'
    buffers, each row being written on exactly one rank, so the sum is exact."""

    def __init__(self, rows: int, length: int, device: torch.device):
        self.logprobs = torch.zeros(rows, length, device=device)
        self.seen = torch.zeros(rows, device=device)

    def put(self, idx: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Rows ``idx`` (of the batch) hold ``logprobs`` (len(idx), T') with T' ≤ T."""
        self.logprobs[idx, : logprobs.shape[1]] = logprobs.detach().float()
        self.seen[idx] = 1.0

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs (B, T), rows (B,) bool)``: every rank's rows, on every rank."""
        return dist.all_reduce_sum(self.logprobs), dist.all_reduce_sum(self.seen) > 0
