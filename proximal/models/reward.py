"""The reward model r_ψ as a model: loading a one-label sequence classifier to train or to score
with, and the Bradley–Terry pair scores of a batch of preference pairs.

``proximal rm`` trains it (:mod:`proximal.trainers.reward`); ``proximal ppo`` and ``grpo`` score with
it (:mod:`proximal.rollout.scoring`); the evaluations read its pair accuracy
(:mod:`proximal.evaluation`).
"""

from __future__ import annotations

import warnings

import torch
from transformers import AutoConfig

from proximal.config import PythonObject
from proximal.models.heads import last_token_scores
from proximal.models.loading import (
    ModelLoadError,
    adapter_task,
    check_path,
    load_sequence_scorer,
)
from proximal.models.policy import with_lora


def load_reward_model(path: str, dtype: str, tokenizer, lora: dict | None = None):
    """``(model, new_head)``: a one-label sequence classifier with ``config.pad_token_id`` set; with
    ``lora`` (r, alpha, target_modules), adapters on its backbone and its score head trained in full.

    A checkpoint whose architecture is already ``...ForSequenceClassification`` keeps its head; any
    other (a causal LM, e.g. the SFT model) gets a fresh zero-initialised one, so every initial score is
    0 and the first steps cannot be dominated by a random head.

    ``path`` may also be a LoRA run's adapters-only export (``output.merge_lora: false``), which has
    no ``config.json``: an SFT run's (causal-LM adapters) is merged into its base model and gets a
    fresh head; a reward model's (``proximal rm``: adapters and its head) keeps its head.
    """
    check_path(path, "model.path")  # before AutoConfig asks the hub for a local path's typo
    task = adapter_task(path)
    new_head = task not in (None, "SEQ_CLS") or (task is None and not _is_classifier(path))
    model = load_sequence_scorer(path, role="model.path", dtype=dtype, new_head=new_head)
    # HF's own pooling (used by anyone calling model(...).logits on the saved checkpoint) needs it.
    model.config.pad_token_id = tokenizer.pad_token_id
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        warnings.warn(
            f"the tokenizer's pad token is its EOS token ({tokenizer.eos_token!r}): score this reward "
            "model with proximal.models.heads.last_token_scores (as proximal ppo does), not with "
            "model(...).logits, whose pooling skips the trailing EOS",
            stacklevel=2,
        )
    return with_lora(model, "SEQ_CLS", lora), new_head


def _is_classifier(path: str) -> bool:
    """Whether the checkpoint at ``path`` (or the model given from Python) is a
    ``...ForSequenceClassification`` (its config.json)."""
    if isinstance(path, PythonObject):
        model = path.value[0] if isinstance(path.value, (tuple, list)) else path.value
        return type(model).__name__.endswith("ForSequenceClassification")
    try:
        architectures = AutoConfig.from_pretrained(path).architectures or []
    except Exception as e:
        raise ModelLoadError(f"model.path: cannot read a model config from {path!r}: {e}") from e
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def pair_scores(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_w, r_l)``, each (B,), from a batch built by
    :func:`proximal.data.preferences.collate_pairs` (chosen rows first)."""
    scores = last_token_scores(model, batch["input_ids"], batch["attention_mask"]).float()
    B = scores.shape[0] // 2
    return scores[:B], scores[B:]
