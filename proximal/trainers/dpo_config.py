"""The ``proximal dpo`` and ``proximal simpo`` configurations: every field documented, validated and
read by ``trainers/dpo.py``.

The ``model``, ``data``, ``optim``, ``train`` and ``output`` sections of both commands extend the
shared ones of :mod:`proximal.train.sections` (a frozen starting model to hold, pairs that may be
truncated, the held-out KL; DPO's precomputed reference); ``dpo`` and ``simpo`` are each method's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from proximal.config import option, reworded, section, section_problems
from proximal.core import DPO_LOSS_TYPES
from proximal.core.ranges import problem
from proximal.data.preferences import ON_TOO_LONG_PAIRS
from proximal.train.fixed import batch_split_problems
from proximal.train.sections import (
    CHAT_TEMPLATE_HELP,
    FROZEN_SHARDING,
    BatchTrainSection,
    EvalSection,
    ExportOutputSection,
    OptimSection,
    PolicyModelSection,
    PreferenceDataSection,
    keep_best_problems,
)
from proximal.train.trl_names import TRL_NAMES


@dataclass
class PreferencePolicyModel(PolicyModelSection):
    path: str = reworded(
        PolicyModelSection,
        "path",
        "The policy as it starts, usually the SFT model: a local Hugging Face checkpoint directory "
        "or a hub id. It is also the starting model the held-out KL is measured against, and "
        "DPO's reference π_ref (frozen; with LoRA the same weights with the adapters off). Its "
        "tokenizer is loaded from the same place. Required.",
    )
    frozen_sharding: str = option(
        "shard",
        "With several processes, how a frozen copy of the starting model (DPO's "
        "reference; the model of eval/kl) is held: 'shard' splits it with FSDP2 "
        "like the policy (least memory; an all-gather per layer per forward), "
        "'replicate' keeps a full copy on every rank (no communication).",
        choices=FROZEN_SHARDING,
    )
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP)


@dataclass
class PairData(PreferenceDataSection):
    on_too_long: str = option(
        "error",
        "A pair where either side is longer than max_length: 'error' stops with its "
        "file:line; 'skip' drops the pair (counted in metrics.jsonl); 'truncate' keeps "
        "each side's first max_length tokens — the whole prompt and the start of the "
        "response (counted) — and a prompt that leaves no room for a response is an "
        "error naming its row.",
        choices=ON_TOO_LONG_PAIRS,
    )


@dataclass
class PreferenceTrainSection(BatchTrainSection):
    eval_kl: bool = option(
        True,
        "Log eval/kl, the exact KL of the policy to the starting model on the held-out "
        "responses. Where no reference is resident (SimPO, or DPO with "
        "train.precompute_ref_logprobs and no LoRA) the starting model is loaded for each "
        "evaluation and released after it; false never loads it.",
    )


@dataclass
class DPOTrainSection(PreferenceTrainSection):
    precompute_ref_logprobs: bool = option(
        False,
        "Compute log π_ref of every pair once, from the initial policy, "
        "before the first update, and hold no reference model while "
        "training (a full fine-tune saves one model's weights; with LoRA "
        "it saves a forward pass per step).",
    )


@dataclass
class DPOSection:
    beta: float = option(
        0.1,
        "β: how far the policy may move from the reference (the implicit KL constraint's "
        "weight). 0.1 is the usual value; 0.01–0.5 is the sensible range.",
    )
    loss_type: str = option(
        "sigmoid",
        "sigmoid: DPO's −log σ(h) (Rafailov et al. 2023); robust: the label-noise "
        "unbiased loss (Chowdhury et al. 2024); ipo: (h − 1/(2β))² on per-token mean "
        "log-ratios (Azar et al. 2023).",
        choices=DPO_LOSS_TYPES,
    )
    label_smoothing: float = option(
        0.0,
        "ε ∈ [0, 0.5): the assumed share of flipped labels. sigmoid: conservative "
        "DPO; robust: the unbiased estimator; must be 0 for ipo.",
    )

    def problems(self, name: str = "dpo") -> list[str]:
        e = [
            m
            for m in (
                problem("dpo_beta", self.beta, f"{name}.beta"),
                problem("label_smoothing", self.label_smoothing, f"{name}.label_smoothing"),
            )
            if m
        ]
        if self.loss_type == "ipo" and self.label_smoothing != 0:
            e.append(
                f"{name}.label_smoothing = {self.label_smoothing}: the ipo loss has no label-noise variant; use 0"
            )
        return e


@dataclass
class SimPOSection:
    beta: float = option(
        2.0,
        "β: the scale of the length-normalised reward β·avg log π(y|x). The paper uses 2–10 "
        "(2.0–2.5 for base models, up to 10 for instruct ones).",
    )
    gamma_beta_ratio: float = option(
        0.5,
        "γ/β: the target reward margin γ as a multiple of β (γ = ratio·β), as the "
        "official code parameterises it. 0.3–0.8 works; 0 = no margin.",
    )

    def problems(self, name: str = "simpo") -> list[str]:
        return [
            m
            for m in (
                problem("simpo_beta", self.beta, f"{name}.beta"),
                problem("gamma_beta_ratio", self.gamma_beta_ratio, f"{name}.gamma_beta_ratio"),
            )
            if m
        ]


@dataclass
class PreferenceEvalSection(EvalSection):
    """``eval`` of dpo and simpo: the shared section, plus a reward model to score with (these
    methods train on none)."""

    reward_model: str | None = option(
        None,
        "A frozen reward model (proximal rm writes one) to score the sampled responses with, "
        "logged as eval/proxy; null = none.",
    )

    def problems(self, name: str = "eval") -> list[str]:
        e = super().problems(name)
        if self.pass_k is not None and self.pass_score is None:  # no total score to default to
            e.append(
                f"{name}.pass_k = {self.pass_k} needs {name}.pass_score: dpo and simpo train on "
                f"no score, so name the one pass@k reads (a name of {name}.scores, or proxy with "
                f"{name}.reward_model)"
            )
        return e


@dataclass
class DPOConfig:
    """``proximal dpo`` configuration."""

    FOREIGN_NAMES: ClassVar[dict[str, str]] = TRL_NAMES["dpo"]

    model: PreferencePolicyModel = section(
        PreferencePolicyModel, "The policy π_θ and, frozen, its reference π_ref."
    )
    data: PairData = section(PairData, "Preference pairs (the files proximal rm reads).")
    optim: OptimSection = section(OptimSection, "Optimisation.", lr=5e-7, schedule="linear")
    train: DPOTrainSection = section(
        DPOTrainSection, "Steps, batches (counting pairs), devices, checkpoints.", save_every=500
    )
    output: ExportOutputSection = section(
        ExportOutputSection, "Where the run is written.", dir="runs/dpo"
    )
    dpo: DPOSection = section(DPOSection, "The DPO loss.")
    eval: PreferenceEvalSection = section(
        PreferenceEvalSection, "Held-out prompts sampled while the policy trains (eval/* metrics)."
    )

    def validate(self) -> list[str]:
        return (
            section_problems(self)
            + batch_split_problems(self.train.batch_size, self.train.micro_batch_size)
            + keep_best_problems(
                self.output,
                self.eval.prompts is not None or self.data.eval_file is not None,
                "data.eval_file or eval.prompts",
            )
        )


@dataclass
class SimPOConfig:
    """``proximal simpo`` configuration."""

    FOREIGN_NAMES: ClassVar[dict[str, str]] = TRL_NAMES["simpo"]

    model: PreferencePolicyModel = section(
        PreferencePolicyModel, "The policy π_θ (SimPO has no reference)."
    )
    data: PairData = section(PairData, "Preference pairs (the files proximal rm reads).")
    optim: OptimSection = section(OptimSection, "Optimisation.", lr=5e-7, schedule="linear")
    train: PreferenceTrainSection = section(
        PreferenceTrainSection,
        "Steps, batches (counting pairs), devices, checkpoints.",
        save_every=500,
    )
    output: ExportOutputSection = section(
        ExportOutputSection, "Where the run is written.", dir="runs/simpo"
    )
    simpo: SimPOSection = section(SimPOSection, "The SimPO loss.")
    eval: PreferenceEvalSection = section(
        PreferenceEvalSection, "Held-out prompts sampled while the policy trains (eval/* metrics)."
    )

    def validate(self) -> list[str]:
        return (
            section_problems(self)
            + batch_split_problems(self.train.batch_size, self.train.micro_batch_size)
            + keep_best_problems(
                self.output,
                self.eval.prompts is not None or self.data.eval_file is not None,
                "data.eval_file or eval.prompts",
            )
        )
