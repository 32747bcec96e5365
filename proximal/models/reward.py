"""The reward model r_ψ as a model: loading a one-label sequence classifier to train or to score
with, and the Bradley–Terry pair scores of a batch of preference pairs.

``proximal rm`` trains it (:mod:`proximal.trainers.reward`); ``proximal ppo`` and ``grpo`` score with
it (:mod:`proximal.rollout.scoring`); the evaluations read its pair accuracy
(:mod:`proximal.evaluation`).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from proximal.models.heads import last_token_scores
from proximal.models.loading import (
    ModelLoadError,
    backbone,
    load_causal_lm,
    load_sequence_scorer,
    score_head,
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
    task = _adapter_task(path)
    if task is not None and task != "SEQ_CLS":
        model, new_head = _new_head_on(load_causal_lm(path, role="model.path", dtype=dtype)), True
    else:
        new_head = task is None and not _is_classifier(path)
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
    """Whether the checkpoint at ``path`` is a ``...ForSequenceClassification`` (its config.json)."""
    try:
        architectures = AutoConfig.from_pretrained(path).architectures or []
    except Exception as e:
        raise ModelLoadError(f"model.path: cannot read a model config from {path!r}: {e}") from e
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def _adapter_task(path: str) -> str | None:
    """The peft ``task_type`` of a LoRA adapters-only export at ``path`` ('CAUSAL_LM', 'SEQ_CLS'), or
    None when ``path`` is not one (a plain checkpoint, a hub id)."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("task_type") or "CAUSAL_LM"
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model.path: cannot read {config}: {e}") from e


def _new_head_on(causal):
    """A one-label sequence classifier with the backbone of the causal LM ``causal`` (its tensors
    copied, the LM head dropped) and a zero-initialised head: what :func:`load_sequence_scorer` with
    ``new_head=True`` makes of a causal-LM checkpoint, for a causal LM that exists only in memory
    (adapters merged into their base)."""
    config = copy.deepcopy(causal.config)
    config.num_labels, config.architectures = 1, None
    scorer = AutoModelForSequenceClassification.from_config(config, dtype=causal.dtype)
    # The same backbone module in both heads (base_model_prefix): strict, so no tensor is left behind.
    backbone(scorer).load_state_dict(backbone(causal).state_dict())
    with torch.no_grad():
        head = score_head(scorer)
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    scorer.config.architectures = [type(scorer).__name__]
    return scorer


def pair_scores(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r_w, r_l)``, each (B,), from a batch built by
    :func:`proximal.data.preferences.collate_pairs` (chosen rows first)."""
    scores = last_token_scores(model, batch["input_ids"], batch["attention_mask"]).float()
    B = scores.shape[0] // 2
    return scores[:B], scores[B:]
