"""The GRPO run configuration (GRPO, Dr. GRPO, DAPO, RLOO): every field documented, validated and read
by ``trainers/grpo.py``.

The ``model``, ``data``, ``optim``, ``train`` and ``output`` sections are the shared ones of
:mod:`proximal.train.sections`; ``rollout`` is the shared one plus the group size; ``grpo`` is
GRPO's own. docs/grpo.md explains every field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from proximal.config import check_divides, option, section, section_problems
from proximal.core.ranges import problem
from proximal.train.run import check_per_rank
from proximal.train.sections import (
    EnvSection,
    EvalSection,
    OnlineModelSection,
    OptimSection,
    PromptDataSection,
    RLOutputSection,
    RLTrainSection,
    RolloutSection,
    ToolsSection,
    agent_problems,
    keep_best_problems,
)
from proximal.train.trl_names import TRL_NAMES

#: ``grpo.loss`` → the loss aggregation it names (proximal.core.stats.masked_aggregate).
LOSSES = {
    "grpo": "seq-mean-token-mean",  # Shao et al. 2024, eq. 3: mean over each response, then over responses
    "dr_grpo": "seq-mean-token-sum-norm",  # Liu et al. 2025: Σ over tokens ÷ rollout.max_new_tokens
    "dapo": "token-mean",  # Yu et al. 2025, §3.3: mean over every token of the batch
}
#: ``grpo.advantage`` → the ``scale`` of core.group_advantages, or None for RLOO's leave-one-out baseline.
#: (Dr. GRPO's "no scaling" is spelled ``unscaled`` here: the config loader reads a bare ``none`` as null.)
ADVANTAGES = {"group": "group", "batch": "batch", "unscaled": "none", "rloo": None}
#: ``grpo.advantage`` of REINFORCE++ (Hu et al. 2025) → core.reinforce_pp_advantages' ``baseline``:
#: per-token returns-to-go whitened over the batch, after (``_baseline``) subtracting the group mean.
REINFORCE_PP = {"reinforce_pp": False, "reinforce_pp_baseline": True}
#: ``grpo.objective`` → the ``grpo.loss`` values it can use (the first is its own, what null means).
#: clip: GRPO's clipped token ratio (core.grpo_policy_loss) under any aggregation; gspo / gspo_token:
#: the sequence ratio of core.gspo_policy_loss, a mean over responses (= grpo's aggregation); cispo:
#: core.cispo_policy_loss, a mean over every token (= dapo's).
OBJECTIVES = {
    "clip": ("grpo", "dr_grpo", "dapo"),
    "gspo": ("grpo",),
    "gspo_token": ("grpo",),
    "cispo": ("dapo",),
}


@dataclass
class GroupRolloutSection(RolloutSection):
    group_size: int = option(
        8,
        "G: responses sampled per prompt. Each response's advantage compares it with the "
        "others of its group, so G ≥ 2; a step trains on rollout.batch_size × G responses.",
    )

    def problems(self, name: str = "rollout") -> list[str]:
        e = super().problems(name)
        if self.group_size < 1:  # ≥ 2 unless grpo.advantage is reinforce_pp: GRPOConfig.validate
            e.append(f"{name}.group_size = {self.group_size} must be ≥ 1")
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
    objective: str = option(
        "clip",
        "Policy objective: clip (GRPO's clipped token ratio, with DAPO's clip-higher and "
        "grpo.dual_clip), gspo (GSPO's length-normalised sequence ratio, clipped per response; "
        "its paper's grpo.clip_eps 3e-4, clip_eps_high 4e-4), gspo_token (GSPO-token, the "
        "same ratio with a per-token gradient) or cispo (CISPO: REINFORCE with the clipped ratio "
        "as a stop-gradient weight, no token dropped; grpo.clip_eps_high caps it, grpo.clip_eps "
        "null = no lower clip).",
        choices=tuple(OBJECTIVES),
    )
    loss: str | None = option(
        None,
        "Loss aggregation: grpo (mean over each response's tokens, then over responses), "
        "dr_grpo (Σ over tokens ÷ rollout.max_new_tokens: no length bias) or dapo (mean over "
        "every token of the mini-batch); null = the objective's own (clip: grpo, gspo and "
        "gspo_token: grpo, cispo: dapo — the only one each of those three takes).",
        choices=(*LOSSES, None),
    )
    advantage: str = option(
        "group",
        "Advantage: group ((r − group mean) / group std, GRPO), batch (÷ the batch's "
        "std), unscaled (r − group mean, Dr. GRPO), rloo (r − mean of the other "
        "responses, RLOO), reinforce_pp (REINFORCE++: per-token returns of the score and "
        "the KL reward, whitened over the batch; rollout.group_size may be 1) or "
        "reinforce_pp_baseline (the group mean subtracted from the scores first).",
        choices=tuple(ADVANTAGES) + tuple(REINFORCE_PP),
    )
    advantage_eps: float = option(1e-4, "ε added to the std in grpo.advantage group and batch.")
    clip_eps: float | None = option(
        0.2,
        "ε: the ratio is clipped below at 1 − ε (and above at 1 + ε unless "
        "grpo.clip_eps_high is set). null only with grpo.objective cispo: no lower clip.",
    )
    clip_eps_high: float | None = option(
        None,
        "ε_high: the upper clip at 1 + ε_high (DAPO's clip-higher: 0.28); null = grpo.clip_eps.",
    )
    dual_clip: float | None = option(
        None,
        "c > 1: dual-clip PPO's bound (Ye et al. 2020; verl's clip_ratio_c, 3): a token with "
        "Â < 0 loses at most c·|Â| however far its ratio grows (objective clip only); null = off.",
    )
    beta: float = option(
        0.04,
        "β of the KL to the reference (DeepSeekMath: 0.04). 0 loads no reference model at all.",
    )
    kl: str = option(
        "loss",
        "Where the KL to the reference goes: loss (β·k3 per token in the loss, GRPO's) or "
        "reward (a per-token penalty β·(log π_old − log π_ref) in the rewards, REINFORCE++'s: "
        "in the returns before whitening with grpo.advantage reinforce_pp*, else added to each "
        "response's group advantage as Â_i − β·Σ_{t' ≥ t} k1_{t'}).",
        choices=("loss", "reward"),
    )
    entropy_coef: float = option(
        0.0,
        "c_ent ≥ 0: an entropy bonus, −c_ent·S[π_θ] added to the loss (aggregated like it); "
        "0 = none (the entropy is then only logged).",
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

    FOREIGN_NAMES: ClassVar[dict[str, str]] = TRL_NAMES["grpo"]

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
    env: EnvSection = section(
        EnvSection, "A multi-turn environment (docs/agents.md); null factory = none."
    )
    tools: ToolsSection = section(
        ToolsSection, "Tool functions the policy calls (docs/agents.md); empty = none."
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
        e += self.rollout.precision_problems(self.train.precision)
        e = agent_problems(e, self.env, self.tools, self.rollout)
        r, g = self.rollout, self.grpo
        if g.iterations < 1:
            e.append(f"grpo.iterations = {g.iterations} must be ≥ 1")
        # whole prompts (so whole groups) per process
        check_per_rank(e, "rollout.batch_size", r.batch_size)
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
            # each process's share of a mini-batch must split into micro-batches too
            if len(e) == before:
                check_per_rank(e, mb_name, mb, "grpo.micro_batch_size", g.micro_batch_size)
        for key, field, value in (
            ("clip_eps", "grpo.clip_eps", g.clip_eps),
            ("beta", "grpo.beta", g.beta),
            ("group_eps", "grpo.advantage_eps", g.advantage_eps),
            ("clip_eps_high", "grpo.clip_eps_high", g.clip_eps_high),
            ("dual_clip", "grpo.dual_clip", g.dual_clip),
            ("beta", "grpo.entropy_coef", g.entropy_coef),  # the same range: [0, ∞)
        ):
            msg = problem(key, value, field) if value is not None else None
            if msg:
                e.append(msg)
        e += self._objective_problems()
        return e

    def _objective_problems(self) -> list[str]:
        """What grpo.objective, grpo.loss, grpo.advantage and grpo.kl allow together."""
        e, r, g = [], self.rollout, self.grpo
        if g.objective not in OBJECTIVES:
            return e  # the loader already named the choices
        usable = OBJECTIVES[g.objective]
        if g.loss is not None and g.loss not in usable:
            e.append(
                f"grpo.loss = {g.loss!r} cannot be used with grpo.objective {g.objective}, whose "
                f"loss is a mean {'over every token' if usable == ('dapo',) else 'over responses'}: "
                f"set grpo.loss to null (or {usable[0]})"
            )
        if g.clip_eps is None and g.objective != "cispo":
            e.append(
                f"grpo.clip_eps = null (no lower clip) is only for grpo.objective cispo, not "
                f"{g.objective}: set grpo.clip_eps (e.g. 0.2)"
            )
        per_token = g.advantage in REINFORCE_PP or g.kl == "reward"
        if g.objective == "gspo" and per_token:
            why = (
                f"grpo.advantage {g.advantage}" if g.advantage in REINFORCE_PP else "grpo.kl reward"
            )
            e.append(
                f"grpo.objective gspo takes one advantage per response, but {why} gives one per "
                "token: use grpo.objective gspo_token (GSPO's per-token form)"
            )
        if g.objective == "cispo" and g.clip_eps is None and g.clip_eps_high is None:
            e.append(
                "grpo.objective cispo needs grpo.clip_eps_high (the cap 1 + ε_high of its weight)"
            )
        if g.dual_clip is not None and g.objective != "clip":
            e.append(
                f"grpo.dual_clip bounds the clipped token surrogate of grpo.objective clip, not "
                f"{g.objective}: set grpo.dual_clip to null"
            )
        if r.group_size < 2 and g.advantage != "reinforce_pp":
            e.append(
                f"rollout.group_size = {r.group_size} must be ≥ 2 with grpo.advantage "
                f"{g.advantage}: each response's advantage compares it with the other responses "
                "to its prompt (only reinforce_pp, whose baseline is the batch, takes 1)"
            )
        if g.skip_uniform_groups and r.group_size < 2:
            e.append(
                "grpo.skip_uniform_groups needs rollout.group_size ≥ 2 (a group of one is always "
                "uniform): set it to false"
            )
        if g.kl == "reward" and g.beta == 0:
            e.append(
                "grpo.kl = reward with grpo.beta = 0 adds nothing: set grpo.beta > 0 or kl: loss"
            )
        return e

    @property
    def aggregation(self) -> str:
        """The loss aggregation (core.masked_aggregate's name): grpo.loss, or the objective's own."""
        return LOSSES[self.grpo.loss or OBJECTIVES[self.grpo.objective][0]]
