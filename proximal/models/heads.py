"""Per-token values and last-token scores from a one-label sequence-classification model.

The critic and the reward model are both ``AutoModelForSequenceClassification`` checkpoints with one
label, so they save and load in plain Hugging Face format and the critic can be initialised from the
reward model (as in Ouyang et al. 2022). We do not use the model's own pooled output: it pools the last token whose id
differs from ``pad_token_id``, which is wrong when pad = EOS. We run the backbone and the scalar head
ourselves and choose positions from the attention mask.
"""

from __future__ import annotations

import torch

from proximal.models.loading import accepts_logits_to_keep, backbone, score_head, unwrap
from proximal.models.parallel import autocast


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left padding never shifts them. Shape (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The scalar head applied at every position. Shape: (B, L) from (B, L) inputs."""
    with autocast(model):
        inner = unwrap(model)
        hidden = backbone(inner)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state
        head = score_head(inner)
        return head(hidden.to(next(head.parameters()).dtype)).squeeze(-1)


def last_token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score at each row's last real token (left or right padding). Shape: (B,) from (B, L)."""
    values = token_values(model, input_ids, attention_mask)
    L = attention_mask.shape[1]
    idx = torch.arange(L, device=attention_mask.device).expand_as(attention_mask)
    last = torch.where(attention_mask.bool(), idx, -1).max(dim=1).values
    if (last < 0).any():
        raise ValueError("last_token_scores: a row has no real token")
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def lm_logits(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int, stop: int
) -> torch.Tensor:
    """A causal LM's logits at positions ``start … stop − 1`` only, (B, stop − start, V), contiguous.

    The output layer runs on those positions alone (``logits_to_keep`` as a tensor of positions, in
    every recent ``transformers`` causal LM): a prompt's vocabulary-sized logits are never computed,
    and no slice of a larger logits tensor is kept (its backward would build and zero the whole
    tensor again). Positions count real tokens only, so left padding never shifts them.
    """
    keep = accepts_logits_to_keep(model)
    extra = {"logits_to_keep": torch.arange(start, stop, device=input_ids.device)} if keep else {}
    with autocast(model):
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            **extra,
        ).logits
    return logits if keep else logits[:, start:stop]
