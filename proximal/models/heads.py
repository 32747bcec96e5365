"""Per-token values and last-token scores from a one-label sequence-classification model.

The critic and the reward model are both ``AutoModelForSequenceClassification`` checkpoints with one
label, so they save and load in plain Hugging Face format and the critic can be initialised from the
reward model (as in Ouyang et al. 2022). We do not use the model's own pooled output: it pools the last token whose id
differs from ``pad_token_id``, which is wrong when pad = EOS. We run the backbone and the scalar head
ourselves and choose positions from the attention mask.
"""

from __future__ import annotations

import torch

from proximal.config import ConfigError
from proximal.models.loading import accepts_logits_to_keep, backbone, score_head, unwrap
from proximal.models.parallel import autocast


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left padding never shifts them. Shape (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_values(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scalar head applied at every position. Shape: (B, L) from (B, L) inputs.

    Padded rows: ``attention_mask`` (B, L), positions from it. Packed rows
    (:func:`proximal.data.packing.collate_packed`): ``attention_mask`` None and ``position_ids``
    (B, L) restarting at 0 per sequence, from which transformers keeps attention inside each one.
    """
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    with autocast(model):
        inner = unwrap(model)
        hidden = backbone(inner)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
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
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    start: int,
    stop: int,
    *,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """A causal LM's logits at positions ``start … stop − 1`` only, (B, stop − start, V), contiguous.

    The output layer runs on those positions alone (``logits_to_keep`` as a tensor of positions, in
    every recent ``transformers`` causal LM): a prompt's vocabulary-sized logits are never computed,
    and no slice of a larger logits tensor is kept (its backward would build and zero the whole
    tensor again). Positions count real tokens only, so left padding never shifts them. Packed rows
    pass ``position_ids`` and no ``attention_mask``, as in :func:`token_values`.
    """
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    keep = accepts_logits_to_keep(model)
    extra = {"logits_to_keep": torch.arange(start, stop, device=input_ids.device)} if keep else {}
    with autocast(model):
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **extra,
        ).logits
    return logits if keep else logits[:, start:stop]


#: Attention implementations that keep a packed row's sequences apart from ``position_ids`` alone:
#: transformers' mask builders (``masking_utils``, 5.x) read the position restarts when the attention
#: mask is None and AND a same-sequence condition into the mask for sdpa, eager and flex attention.
#: Flash attention reads them through another path (``cu_seqlens`` from the position ids) that no
#: test here can run on a CPU, so it is refused rather than trusted unchecked.
PACKED_ATTENTION = ("sdpa", "eager")


def check_packing(model) -> None:
    """ConfigError unless ``model`` keeps attention inside each packed sequence.

    First by name (:data:`PACKED_ATTENTION`), then by a probe: two short sequences packed in one
    row must give the second the logits it gets alone (an architecture that builds its mask without
    the position ids would let it see the first). Run it after the optimiser is built: it is a
    forward pass (module docstring of :mod:`proximal.train.fixed`).
    """
    inner = unwrap(model)
    impl = getattr(inner.config, "_attn_implementation", None)
    if impl not in PACKED_ATTENTION:
        raise ConfigError(
            f"train.packing: true needs attention that keeps packed sequences apart "
            f"({', '.join(PACKED_ATTENTION)}); the model's attention implementation is {impl!r}. "
            "Set train.packing: false"
        )
    dev = next(model.parameters()).device
    vocab = inner.config.vocab_size
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab, (2, 6), generator=g).to(dev)
    pos = torch.arange(6, device=dev)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            both = lm_logits(
                model,
                torch.cat([a, b])[None],
                None,
                6,
                12,
                position_ids=torch.cat([pos, pos])[None],
            )
            alone = lm_logits(model, b[None], None, 0, 6, position_ids=pos[None])
    finally:
        model.train(was_training)
    fp32 = next(model.parameters()).dtype == torch.float32
    if not torch.allclose(
        both.float(), alone.float(), rtol=1e-3 if fp32 else 5e-2, atol=1e-4 if fp32 else 5e-2
    ):
        raise ConfigError(
            f"train.packing: true: {type(inner).__name__} with {impl!r} attention lets a packed "
            "sequence attend to the one before it in this transformers version; set "
            "train.packing: false"
        )


def packed_scores(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """The score at each packed sequence's last token: (N,) from packed (R, L) rows and the flat
    indices ``last`` (N,) of :func:`proximal.data.packing.collate_packed`."""
    values = token_values(model, input_ids, None, position_ids=position_ids)
    return values.reshape(-1)[last]
