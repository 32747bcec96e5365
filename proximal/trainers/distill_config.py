"""The on-policy distillation run configuration: every field documented, validated and read by
``trainers/distill.py``.

The ``data``, ``optim``, ``train``, ``output`` and ``eval`` sections are the shared ones of
:mod:`proximal.train.sections`; ``model`` is the online one plus the teacher; ``rollout`` is GRPO's
(with one response per prompt by default); ``distill`` is the method's own. docs/distill.md
explains every field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from proximal.config import check_divides, option, section, section_problems
from proximal.core.ranges import problem
from proximal.train.run import check_per_rank
from proximal.train.sections import (
    NO_REWARD,
    EnvSection,
    EvalSection,
    OnlineModelSection,
    OptimSection,
    PromptDataSection,
    RLOutputSection,
    RLTrainSection,
    ToolsSection,
    keep_best_problems,
)
from proximal.train.trl_names import TRL_NAMES
from proximal.trainers.grpo_config import GroupRolloutSection


@dataclass
class DistillModelSection(OnlineModelSection):
    teacher: str = option(
        "",
        "The teacher π_t (a directory or hub id): loaded frozen like a reference, in "
        "train.precision's frozen dtype and (several processes) under model.frozen_sharding. It "
        "may be larger than the student but must share its tokenizer (the same vocabulary and "
        "special tokens); cross-tokenizer distillation is not supported. Required.",
    )

    def problems(self, name: str = "model") -> list[str]:
        # a reward source is optional here: the teacher grades every token
        e = [p for p in super().problems(name) if not p.endswith(NO_REWARD)]
        if not self.teacher:
            e.append(f"{name}.teacher is required: the teacher model's directory or hub id")
        return e


#: ``distill.loss`` → what the student is trained on.
LOSSES = ("reverse_kl", "jsd")


@dataclass
class DistillLossConfig:
    loss: str = option(
        "reverse_kl",
        "reverse_kl: the sampled per-token reverse KL −(log π_s − log π_t) as a reward through "
        "the clipped surrogate (Thinking Machines' form; distill.discount, distill.reward_weight); "
        "jsd: GKD's generalised JSD(distill.beta) over the whole vocabulary at each sampled "
        "position, minimised directly (a mean over tokens, computed a chunk of positions at a time "
        "from both models' hidden states; no reward).",
        choices=LOSSES,
    )
    beta: float = option(
        0.5,
        "β ∈ [0, 1] of distill.loss jsd, TRL's convention: mixture β·π_t + (1 − β)·π_s; 0 is "
        "KL(π_t ‖ π_s) (forward), 1 is KL(π_s ‖ π_t) (reverse).",
    )
    lam: float = option(
        0.0,
        "∈ [0, 1], the share of teacher-written responses (distill.loss jsd): each response is, "
        "with this probability, its prompt row's teacher-written completion (the column "
        "distill.completion_column) instead of a student sample; 0 = every response the "
        "student's own (on-policy). It is 1 − GKD's λ (TRL's lmbda), the student's share.",
    )
    completion_column: str = option(
        "completion",
        "The prompts' column holding the teacher-written completion, read when distill.lam > 0 "
        "(data.columns can rename a column to it).",
    )
    discount: float = option(
        0.0,
        "γ ∈ [0, 1]: each token's advantage is the discounted sum of the per-token rewards "
        "−(log π_s − log π_t) from it on; 0 (Thinking Machines' on-policy distillation) grades "
        "each token alone.",
    )
    reward_weight: float = option(
        1.0,
        "w ≥ 0: the weight of the verifier reward (model.reward_functions, model.reward_model, "
        "…; none: nothing is added) in the advantage, A_t += w·(r_i − mean of its group's "
        "scores), which needs rollout.group_size ≥ 2. 0 logs the scores without training on them.",
    )
    iterations: int = option(
        1, "μ: passes over each generation batch against π_old, the policy that sampled it."
    )
    mini_batch_size: int | None = option(
        None,
        "Responses per optimiser step, over all processes together; null = the whole generation "
        "batch (rollout.batch_size × rollout.group_size), one optimiser step per iteration.",
    )
    micro_batch_size: int = option(
        4,
        "Responses per forward/backward on one process (gradient accumulation within a "
        "mini-batch); also the micro-batch of the student's and the teacher's log-probabilities "
        "and of the reward model.",
    )
    clip_eps: float = option(
        0.2,
        "ε: the ratio π_θ/π_old of the clipped surrogate is clipped to [1 − ε, 1 + ε] (or "
        "1 + distill.clip_eps_high); with μ = 1 and one mini-batch the ratio is 1.",
    )
    clip_eps_high: float | None = option(
        None, "ε_high: the upper clip at 1 + ε_high; null = distill.clip_eps."
    )


#: The loss aggregation: a mean over every valid token of the mini-batch (each token is graded alone).
AGGREGATION = "token-mean"


@dataclass
class DistillConfig:
    """Everything an on-policy distillation run needs; see docs/distill.md for each field."""

    FOREIGN_NAMES: ClassVar[dict[str, str]] = TRL_NAMES["distill"]

    model: DistillModelSection = section(DistillModelSection)
    data: PromptDataSection = section(PromptDataSection)
    rollout: GroupRolloutSection = section(GroupRolloutSection, group_size=1)
    distill: DistillLossConfig = section(DistillLossConfig)
    optim: OptimSection = section(OptimSection, lr=1e-6)
    train: RLTrainSection = section(RLTrainSection)
    output: RLOutputSection = section(RLOutputSection, dir="runs/distill")
    eval: EvalSection = section(
        EvalSection, "Held-out prompts sampled while the student trains (eval/* metrics)."
    )

    # One response per prompt row, no environment and no tools (the online layer reads these).
    @property
    def env(self) -> EnvSection:
        return EnvSection()

    @property
    def tools(self) -> ToolsSection:
        return ToolsSection()

    @property
    def responses_per_step(self) -> int:
        return self.rollout.batch_size * self.rollout.group_size

    @property
    def mini_batch_size(self) -> int:
        """distill.mini_batch_size, or the whole generation batch."""
        d = self.distill
        return self.responses_per_step if d.mini_batch_size is None else d.mini_batch_size

    @property
    def has_reward(self) -> bool:
        m = self.model
        return bool(
            m.reward_model is not None or m.reward_functions or m.reward_urls or m.reward_judges
        )

    def validate(self) -> list[str]:
        e = section_problems(self)
        e += keep_best_problems(self.output, self.eval.prompts is not None, "eval.prompts")
        e += self.rollout.precision_problems(self.train.precision)
        r, d = self.rollout, self.distill
        if d.iterations < 1:
            e.append(f"distill.iterations = {d.iterations} must be ≥ 1")
        check_per_rank(e, "rollout.batch_size", r.batch_size)
        mb, mb_name = self.mini_batch_size, "distill.mini_batch_size"
        if d.mini_batch_size is None:
            mb_name = "rollout.batch_size × rollout.group_size"
        else:
            check_divides(
                e, "rollout.batch_size × rollout.group_size", self.responses_per_step, mb_name, mb
            )
        if mb > 0:
            before = len(e)
            check_divides(e, mb_name, mb, "distill.micro_batch_size", d.micro_batch_size)
            if len(e) == before:
                check_per_rank(e, mb_name, mb, "distill.micro_batch_size", d.micro_batch_size)
        for key, name, value in (
            ("clip_eps", "distill.clip_eps", d.clip_eps),
            ("clip_eps_high", "distill.clip_eps_high", d.clip_eps_high),
        ):
            msg = problem(key, value, name) if value is not None else None
            if msg:
                e.append(msg)
        if not 0.0 <= d.reward_weight < math.inf:
            e.append(f"distill.reward_weight = {d.reward_weight} must be a finite number ≥ 0")
        if not 0.0 <= d.lam <= 1.0:
            e.append(f"distill.lam = {d.lam} must be in [0, 1]")
        elif d.lam > 0 and self.rollout.staleness > 0:
            e.append(
                f"distill.lam = {d.lam} with rollout.staleness {self.rollout.staleness}: the "
                "teacher-written rows are mixed in synchronously; use rollout.staleness: 0"
            )
        elif d.lam > 0 and d.loss != "jsd":
            e.append(
                f"distill.lam = {d.lam} mixes in teacher-written completions, which the "
                "policy-gradient form distill.loss reverse_kl cannot train on (they are not the "
                "student's samples): use distill.loss jsd, or distill.lam: 0"
            )
        if not 0.0 <= d.beta <= 1.0:
            e.append(f"distill.beta = {d.beta} must be in [0, 1]")
        if d.loss == "jsd":
            e += self._jsd_problems()
        if not 0.0 <= d.discount <= 1.0:
            e.append(f"distill.discount = {d.discount} must be in [0, 1]")
        if self.has_reward and d.reward_weight > 0 and r.group_size < 2:
            e.append(
                f"rollout.group_size = {r.group_size} must be ≥ 2 with a reward and "
                f"distill.reward_weight = {d.reward_weight} > 0: the reward's baseline is the "
                "mean of its group (or set distill.reward_weight: 0)"
            )
        return e

    def _jsd_problems(self) -> list[str]:
        """What distill.loss jsd does not combine with: it is minimised directly, so there is no
        advantage for a discount or a reward to enter, and no ratio to correct."""
        e, d, r = [], self.distill, self.rollout
        if d.discount != 0.0:
            e.append(
                f"distill.discount = {d.discount} has no effect with distill.loss jsd (the "
                "divergence is minimised at each position directly): set it to 0 or use reverse_kl"
            )
        if self.has_reward and d.reward_weight > 0:
            e.append(
                "distill.loss jsd takes no reward (there is no advantage to add it to): use "
                "distill.loss reverse_kl, or set distill.reward_weight: 0 to log the scores only"
            )
        if r.correction_mode not in ("none",):
            e.append(
                f"rollout.correction = {r.correction_mode!r} weighs a policy-gradient ratio, which "
                "distill.loss jsd does not have: set it to null"
            )
        return e
