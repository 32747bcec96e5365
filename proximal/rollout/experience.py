"""Experience: what the update of an online method reads about each sampled response.

The data flow of every online method is rollout (sample + score) → experience → update. PPO's
experience holds the engine's log-probabilities of the sampled tokens log μ (the distribution they
were drawn from), the trainer's recomputation of them log π_old, the reference's log π_ref, the
critic's values V_old and, once computed, advantages and returns; GRPO's and RLOO's the same
without the critic (``values`` and ``returns`` stay None), and with β = 0 without the reference.
Nothing here knows which method it serves.

Under data parallelism each rank computes the experience of its own rows; :func:`gather` then gives
every rank the whole batch (small tensors: ids and per-token numbers), so the update can cut
mini-batches in one global order and every rank trains on its share of each — the same mini-batches
whatever the number of processes.

Notation: B rows, P padded prompt length, T padded response length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from proximal import dist
from proximal.core import truncates
from proximal.models.heads import token_values
from proximal.rollout.sampling import Rollout, response_logprobs


@dataclass
class Experience:
    """One row per sampled response; every (B, T) tensor is aligned with ``rollout.response_ids``.

    valid: (B,) bool — rows the update trains on (a row whose score was not finite is kept, so every
    rank runs the same passes, but masked out of every loss and statistic).
    """

    rollout: Rollout
    scores: torch.Tensor  # (B,) float32, 0 where not valid
    valid: torch.Tensor  # (B,) bool
    # (B, T) log π_old(y_t | s_t); None: π_old is the policy about to take its one optimiser step
    # on this batch (see compute_experience)
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None  # (B, T) log π_ref(y_t | s_t)
    # (B, T) log μ(y_t | s_t): the engine's, from the logits it sampled with (rollout.behaviour_logprobs);
    # π_old/μ is the rollout mismatch (proximal.core.correction)
    behaviour_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None  # (B, T) V_old(s_t)
    advantages: torch.Tensor | None = None  # (B, T) per token, or (B,) per sequence
    returns: torch.Tensor | None = None  # (B, T) V^targ
    # (B, T) log π_old on the full softmax where old_logprobs replays the engine's top-k/top-p
    # (rollout.replay_filter): what the KL terms read; None otherwise (old_logprobs is it)
    old_full_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rollout)

    @property
    def old_unfiltered(self) -> torch.Tensor | None:
        """log π_old on the full tempered softmax, for the KL terms (:attr:`old_full_logprobs`
        under a replayed filter, else :attr:`old_logprobs`)."""
        return self.old_logprobs if self.old_full_logprobs is None else self.old_full_logprobs

    @property
    def mask(self) -> torch.Tensor:
        """The training mask, (B, T) bool: real response tokens of valid rows."""
        return self.rollout.response_mask & self.valid[:, None]

    def replace(self, **changes) -> Experience:
        return dataclasses.replace(self, **changes)

    def select(self, idx: torch.Tensor) -> Experience:
        """Rows ``idx``, with the columns none of them uses trimmed (as :meth:`Rollout.select`)."""
        r = self.rollout.select(idx)
        T = r.response_ids.shape[1]
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "rollout" or v is None:
                continue
            v = v[idx]
            out[f.name] = v[:, :T] if v.dim() == 2 else v
        return Experience(rollout=r, **out)


def _micro_batches(n: int, size: int):
    for start in range(0, n, size):
        yield torch.arange(start, min(start + size, n))


def _pad_to(x: torch.Tensor, T: int) -> torch.Tensor:
    return F.pad(x, (0, T - x.shape[1]))


@torch.no_grad()
def sequence_token_logprobs(
    model,
    rollout: Rollout,
    temperature: float,
    micro_batch_size: int,
    path: str = "fused",
    filter: tuple[int, float] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log π(y_t | s_t) of the sampled tokens under ``model``, (B, T), 0 after the stop; micro-batched.
    ``path``: ``train.logprobs`` (:func:`proximal.rollout.sampling.response_logprobs`). With a
    ``filter`` (top_k, top_p) that truncates: ``(filtered, full)``, the log-probabilities of the
    replayed truncated distribution and of the full softmax."""
    T = rollout.response_ids.shape[1]
    out, full = [], []
    for idx in _micro_batches(len(rollout), micro_batch_size):
        r = rollout.select(idx)
        scores = response_logprobs(model, r, temperature, path=path, filter=filter)
        out.append(_pad_to(scores.logprobs, T))
        full.append(_pad_to(scores.unfiltered, T))
    if filter is not None and truncates(*filter):
        return torch.cat(out), torch.cat(full)
    return torch.cat(out)


def critic_values(critic, r: Rollout) -> torch.Tensor:
    """V_φ(s_t) for each response position t: the head at the token before y_t, (B, T), float32."""
    P = r.prompt_ids.shape[1]
    return token_values(critic, r.input_ids, r.attention_mask)[:, P - 1 : -1].float()


@torch.no_grad()
def compute_experience(
    rollout: Rollout,
    scores: torch.Tensor,
    valid: torch.Tensor,
    *,
    actor,
    reference=None,
    critic=None,
    temperature: float = 1.0,
    micro_batch_size: int = 8,
    old_pass: bool = True,
    logprobs_path: str = "fused",
    filter: tuple[int, float] | None = None,
) -> Experience:
    """log π_old from ``actor``, log π_ref from ``reference`` (a :class:`proximal.models.policy.Reference`,
    or None), V_old from ``critic`` (or None), micro-batch by micro-batch, no gradients.

    ``old_pass=False`` skips the π_old pass (``old_logprobs`` is None): right when the batch gets exactly
    one optimiser step, for then π_old *is* the policy in the update's forward pass, whose own
    log-probabilities, detached, serve as log π_old — ρ = 1 and ∇ρ = ∇log π, the same gradient, one
    forward pass fewer (TRL's GRPOTrainer does the same when it takes one step per generation).

    ``logprobs_path``: ``train.logprobs``, how both log-probabilities are computed (from the hidden
    states, or through the logits: :func:`proximal.models.output.token_logprobs`).

    ``filter``: (top_k, top_p) of ``rollout.replay_filter``: π_old on the engine's truncated support
    (``old_logprobs``) and on the full softmax (``old_full_logprobs``, for the KL terms); π_ref is
    always the full softmax's — the KL compares policies, not sampling procedures."""
    old = full = None
    if old_pass:
        old = sequence_token_logprobs(
            actor, rollout, temperature, micro_batch_size, logprobs_path, filter
        )
        if isinstance(old, tuple):
            old, full = old
    ref = None
    if reference is not None:
        with reference.active() as ref_model:
            ref = sequence_token_logprobs(
                ref_model, rollout, temperature, micro_batch_size, logprobs_path
            )
    values = None
    if critic is not None:
        T = rollout.response_ids.shape[1]
        parts = []
        for idx in _micro_batches(len(rollout), micro_batch_size):
            r = rollout.select(idx)
            parts.append(_pad_to(torch.where(r.response_mask, critic_values(critic, r), 0.0), T))
        values = torch.cat(parts)
    scores = torch.where(valid, scores, 0.0).float()
    return Experience(
        rollout,
        scores,
        valid,
        old,
        ref,
        behaviour_logprobs=rollout.behaviour_logprobs,
        values=values,
        old_full_logprobs=full,
    )


def gather(exp: Experience) -> Experience:
    """The whole batch on every rank, rows in rank order (rank r's rows follow rank r − 1's): prompts
    left-padded and responses right-padded to the widest rank's. The identity in one process."""
    if dist.world_size() == 1:
        return exp
    r = exp.rollout
    device = r.prompt_ids.device
    P, T = (
        int(v)
        for v in dist.all_reduce_max(
            torch.tensor([r.prompt_ids.shape[1], r.response_ids.shape[1]], device=device)
        )
    )

    def left(x):
        return F.pad(x, (P - x.shape[1], 0))

    def right(x):
        return F.pad(x, (0, T - x.shape[1])) if x.dim() == 2 else x

    rollout = Rollout(
        *(
            dist.all_gather_cat(t)
            for t in (
                left(r.prompt_ids),
                left(r.prompt_mask),
                right(r.response_ids),
                right(r.response_mask),
                r.ended,
            )
        ),
        behaviour_logprobs=(
            None
            if r.behaviour_logprobs is None
            else dist.all_gather_cat(right(r.behaviour_logprobs))
        ),
        context_mask=None if r.context_mask is None else dist.all_gather_cat(right(r.context_mask)),
    )
    out = {}
    for f in dataclasses.fields(exp):
        v = getattr(exp, f.name)
        if f.name != "rollout" and v is not None:
            out[f.name] = dist.all_gather_cat(right(v))
    return Experience(rollout=rollout, **out)
