"""The ``proximal rm`` configuration: every field documented, validated and read by ``trainers/reward.py``.

Every section is a shared one of :mod:`proximal.train.sections`; ``model.path`` says what the reward
model may start from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from proximal.config import option, reworded, section, section_problems
from proximal.train.fixed import batch_split_problems
from proximal.train.sections import (
    CHAT_TEMPLATE_HELP,
    RENAMED_BATCH_FIELDS,
    BatchTrainSection,
    ExportOutputSection,
    LoRAModelSection,
    OptimSection,
    PreferenceDataSection,
)
from proximal.train.trl_names import TRL_NAMES


@dataclass
class RMModel(LoRAModelSection):
    path: str = reworded(
        LoRAModelSection,
        "path",
        "Initial weights: a causal-LM checkpoint (usually the SFT model; a zero-initialised "
        "one-output head replaces the LM head) or an existing one-label sequence-"
        "classification checkpoint (trained further as is). Its tokenizer is loaded from "
        "the same place and saved with the result. Required.",
    )
    lora_r: int = reworded(
        LoRAModelSection,
        "lora_r",
        "LoRA rank; 0 trains all weights. r > 0 puts rank-r adapters on the backbone and "
        "trains the score head in full (peft's modules_to_save).",
    )
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP)


@dataclass
class RMConfig:
    """``proximal rm`` configuration."""

    FOREIGN_NAMES: ClassVar[dict[str, str]] = TRL_NAMES["rm"]

    model: RMModel = section(RMModel, "The model the reward model starts from.")
    data: PreferenceDataSection = section(PreferenceDataSection, "Preference pairs.")
    optim: OptimSection = section(OptimSection, "Optimisation.", schedule="linear")
    train: BatchTrainSection = section(
        BatchTrainSection, "Steps, batches (counting pairs), devices, checkpoints.", save_every=500
    )
    output: ExportOutputSection = section(
        ExportOutputSection, "Where the run is written.", dir="runs/rm"
    )

    RENAMED: ClassVar[dict[str, str]] = RENAMED_BATCH_FIELDS

    def validate(self) -> list[str]:
        return section_problems(self) + batch_split_problems(
            self.train.batch_size, self.train.micro_batch_size
        )
