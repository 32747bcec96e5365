"""The ``proximal sft`` configuration: every field documented, validated and read by ``trainers/sft.py``.

The ``model``, ``optim``, ``train`` and ``output`` sections are the shared ones of
:mod:`proximal.train.sections`; ``data`` has the fields, defaults and checks of the preference
commands' data section, worded for prompt/response rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from proximal.config import option, reworded, section, section_problems
from proximal.data.chat import LOSS_ON
from proximal.train.fixed import batch_split_problems
from proximal.train.sections import (
    CHAT_TEMPLATE_HELP,
    DATA_SOURCES,
    RENAMED_BATCH_FIELDS,
    BatchTrainSection,
    ExportOutputSection,
    LoRAModelSection,
    OptimSection,
    PreferenceDataSection,
)
from proximal.train.trl_names import TRL_NAMES


@dataclass
class SFTData(PreferenceDataSection):
    """Prompt/response rows: the same files, length limit and policies for long and empty rows as the
    preference pairs of ``rm``, ``dpo`` and ``simpo`` (their defaults and checks are that section's)."""

    train_file: str = reworded(
        PreferenceDataSection,
        "train_file",
        'Training rows, {"text": str}, {"prompt": str, "completion": str} ("response" an '
        'alias; both may be messages) or {"messages": [...]} conversations, every assistant turn '
        "trained by default (data.loss_on; docs/sft.md): " + DATA_SOURCES + ". Required.",
    )
    eval_file: str | None = reworded(
        PreferenceDataSection,
        "eval_file",
        "Held-out rows in the same format, from any of the same sources, for the held-out loss; "
        "null = no held-out evaluation.",
    )
    max_length: int = reworded(
        PreferenceDataSection,
        "max_length",
        "Longest prompt + response + EOS, in tokens. A longer row is an error "
        "naming its file and line, or is dropped (see on_too_long).",
    )
    on_too_long: str = reworded(
        PreferenceDataSection,
        "on_too_long",
        "What to do with a row longer than max_length: 'error' stops with "
        "its file:line; 'skip' drops it and counts it in metrics.jsonl.",
    )
    on_empty: str = reworded(
        PreferenceDataSection,
        "on_empty",
        "What to do with a row whose response is empty: 'error' stops with its "
        "file:line; 'skip' drops it and counts it in metrics.jsonl.",
    )
    split: str | None = reworded(
        PreferenceDataSection,
        "split",
        "The split of the rows where the data is a DatasetDict (save_to_disk directory or cached "
        "data set name); null = 'train'. A single file is one split, 'train'. See docs/data.md.",
    )
    columns: dict[str, str] | None = reworded(
        PreferenceDataSection,
        "columns",
        "Column names mapped to the names of a row, canonical: column (e.g. {prompt: question, "
        "response: answer}); null = the columns as they are. See docs/data.md.",
    )
    loss_on: str = option(
        "all_assistant",
        "Which tokens the loss covers (docs/data.md): 'all_assistant' every assistant turn of a "
        "conversation (masks from the whole conversation's tokens), a completion, a text row's "
        "every token; 'last_assistant' the last assistant turn only, the earlier turns as prompt; "
        "'completion_only' the completion (assistant turns in a conversational prompt are context); "
        "'all_tokens' every token.",
        choices=LOSS_ON,
    )


@dataclass
class SFTModel(LoRAModelSection):
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP)


@dataclass
class SFTConfig:
    """``proximal sft`` configuration."""

    FOREIGN_NAMES: ClassVar[dict[str, str]] = TRL_NAMES["sft"]

    model: SFTModel = section(
        SFTModel, "The causal LM to fine-tune (all weights, or LoRA adapters)."
    )
    data: SFTData = section(SFTData, "Prompt/response data.")
    optim: OptimSection = section(OptimSection, "Optimisation.", schedule="linear")
    train: BatchTrainSection = section(
        BatchTrainSection, "Steps, batches, devices, checkpoints.", save_every=500
    )
    output: ExportOutputSection = section(
        ExportOutputSection, "Where the run is written.", dir="runs/sft"
    )

    RENAMED: ClassVar[dict[str, str]] = RENAMED_BATCH_FIELDS

    def validate(self) -> list[str]:
        return section_problems(self) + batch_split_problems(
            self.train.batch_size, self.train.micro_batch_size
        )
