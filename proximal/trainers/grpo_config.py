"""The GRPO run configuration (GRPO, Dr. GRPO, DAPO, RLOO): every field documented, validated and read
by ``trainers/grpo.py``.

The ``model``, ``data``, ``optim``, ``train`` and ``output`` sections are the shared ones of
:mod:`proximal.train.sections`; ``rollout`` is the shared one plus the group size; ``grpo`` is
GRPO's own. docs/grpo.md explains every field.
"""

from __future__ import annotations

from dataclasses import dataclass

from proximal.config import check_divides, option, section, section_problems
from proximal.core.ranges import problem
from proximal.train.run import check_per_rank
from proximal.train.sections import (
    EvalSection,
    OnlineModelSection,
    OptimSection,
    PromptDataSection,
    RLOutputSection,
    RLTrainSection,
    RolloutSection,
    keep_best_problems,
)

#: ``grpo.loss`` → the loss aggregation it names (proximal.core.stats.masked_aggregate).
LOSSES = {
    "grpo": "seq-mean-token-mean",  # Shao et al. 2024, eq. 3: mean over each response, then over responses
    "dr_grpo": "seq-mean-token-sum-norm",  # Liu et al. 2025: Σ over tokens ÷ rollout.max_new_tokens
    "dapo": "token-mean",  # Yu et al. 2025, §3.3: mean over every token of the batch
}
#: ``grpo.advantage`` → the ``scale`` of core.group_advantages, or None for RLOO's leave-one-out baseline.
#: (Dr. GRPO's "no scaling" is spelled ``unscaled`` here: the config loader reads a bare ``none`` as null.)
ADVANTAGES = {"group": "group", "batch": "batch", "unscaled": "none", "rloo": None}


@dataclass
class GroupRolloutSection(RolloutSection):
    group_size: int = option(
        8,
        "G: responses sampled per prompt. Each response's advantage compares it with the "
        "others of its group, so G ≥ 2; a step trains on rollout.batch_size × G responses.",
    )

    def problems(self, name: str = "rollout") -> list[str]:
        e = super().problems(name)
        if self.group_size < 2:
            e.append(
                f"{name}.group_size = {self.group_size} must be ≥ 2: each response's advantage compares it "
                "with the other responses to its prompt"
            )
        return e


@dataclass
class GRPOLossConfig:
    iterations: int = option(
        1,
        "μ: passes over each generation batch against π_old, the policy that sampled it "
        "(DeepSeekMath: 1, fully on-policy).",
    )
    mini_batch_size: int | None = option(
        None,
        "Responses per optimiser step, over all processes together; null = "
        "the whole generation batch (rollout.batch_size × rollout.group_size), "
        "one optimiser step per iteration.",
    )
    micro_batch_size: int = option(
        4,
        "Responses per forward/backward on one process (gradient accumulation within a "
        "mini-batch); also the micro-batch of the experience and of the reward model.",
    )
    loss: str = option(
        "grpo",
        "Loss aggregation: grpo (mean over each response's tokens, then over responses), "
        "dr_grpo (Σ over tokens ÷ rollout.max_new_tokens: no length bias) or dapo (mean over "
        "every token of the mini-batch).",
        choices=tuple(LOSSES),
    )
    advantage: str = option(
        "group",
        "Advantage: group ((r − group mean) / group std, GRPO), batch (÷ the batch's "
        "std), unscaled (r − group mean, Dr. GRPO) or rloo (r − mean of the other "
        "responses, RLOO).",
        choices=tuple(ADVANTAGES),
    )
    advantage_eps: float = option(1e-4, "ε added to the std in grpo.advantage group and batch.")
    clip_eps: float = option(
        0.2,
        "ε: the ratio is clipped below at 1 − ε (and above at 1 + ε unless "
        "grpo.clip_eps_high is set).",
    )
    clip_eps_high: float | None = option(
        None,
        "ε_high: the upper clip at 1 + ε_high (DAPO's clip-higher: 0.28); null = grpo.clip_eps.",
    )
    beta: float = option(
        0.04,
        "β of the k3 KL term to the reference in the loss (DeepSeekMath: 0.04). 0 loads no "
        "reference model at all.",
    )
    mask_truncated: bool = option(
        False,
        "Responses that reach rollout.max_new_tokens without a stop contribute no "
        "loss (DAPO's overlong filtering); they still count in their group's "
        "statistics.",
    )
    skip_uniform_groups: bool = option(
        False,
        "Leave out of the update every group whose scores are all equal (no "
        "learning signal; DAPO's dynamic-sampling filter), counted in "
        "data/skipped_uniform_groups.",
    )


@dataclass
class GRPOConfig:
    """Everything a GRPO/RLOO run needs; see docs/grpo.md for each field and what healthy values look like."""

    model: OnlineModelSection = section(OnlineModelSection)
    data: PromptDataSection = section(PromptDataSection)
    rollout: GroupRolloutSection = section(GroupRolloutSection)
    grpo: GRPOLossConfig = section(GRPOLossConfig)
    optim: OptimSection = section(OptimSection, lr=1e-6)
    train: RLTrainSection = section(RLTrainSection)
    output: RLOutputSection = section(RLOutputSection, dir="runs/grpo")
    eval: EvalSection = section(
        EvalSection, "Held-out prompts sampled while the policy trains (eval/* metrics)."
    )

    @property
    def responses_per_step(self) -> int:
        return self.rollout.batch_size * self.rollout.group_size

    @property
    def mini_batch_size(self) -> int:
        """grpo.mini_batch_size, or the whole generation batch."""
        return (
            self.responses_per_step
            if self.grpo.mini_batch_size is None
            else self.grpo.mini_batch_size
        )

    def validate(self) -> list[str]:
        e = section_problems(self)
        e += keep_best_problems(self.output, self.eval.prompts is not None, "eval.prompts")
        r, g = self.rollout, self.grpo
        if g.iterations < 1:
            e.append(f"grpo.iterations = {g.iterations} must be ≥ 1")
        check_per_rank(
            e, "rollout.batch_size", r.batch_size
        )  # whole prompts (so whole groups) per process
        mb, mb_name = self.mini_batch_size, "grpo.mini_batch_size"
        if g.mini_batch_size is None:
            mb_name = "rollout.batch_size × rollout.group_size"
        else:
            check_divides(
                e, "rollout.batch_size × rollout.group_size", self.responses_per_step, mb_name, mb
            )
        if mb > 0:
            before = len(e)
            check_divides(e, mb_name, mb, "grpo.micro_batch_size", g.micro_batch_size)
            if (
                len(e) == before
            ):  # each process's share of a mini-batch must split into micro-batches too
                check_per_rank(e, mb_name, mb, "grpo.micro_batch_size", g.micro_batch_size)
        for key, field, value in (
            ("clip_eps", "grpo.clip_eps", g.clip_eps),
            ("beta", "grpo.beta", g.beta),
            ("group_eps", "grpo.advantage_eps", g.advantage_eps),
            ("clip_eps_high", "grpo.clip_eps_high", g.clip_eps_high),
        ):
            msg = problem(key, value, field) if value is not None else None
            if msg:
                e.append(msg)
        return e
