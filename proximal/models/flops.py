"""Model FLOPs: what a forward pass, a training pass and a decode cost, counted as in the literature.

The count is the one MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM appendix B) divides by
the device's peak: the matrix products the model's arithmetic needs, not what the hardware ran.

- **Parameters.** ``N`` counts the weights of matrix products: every parameter of two or more
  dimensions, except an embedding lookup's table (``nn.Embedding``: token and learned position
  embeddings are indexed, not multiplied — Kaplan et al. 2020 leave them out of ``N`` too). Vectors
  (norm gains, biases) are left out: their cost is elementwise. ``N`` is split into the **body**
  (the blocks, and any small head such as a critic's or a reward model's one-label score) and the
  **head** — the language-model output layer ``get_output_embeddings()``, V × d, counted even when
  it is tied to the input embedding (the product is computed either way) — because the head runs
  only on the positions whose logits are needed, often far fewer than the body's.
- **A product of two activations** (attention): per layer, ``Q·Kᵀ`` and ``softmax·V`` cost
  ``2·s·s·d_attn`` each on a sequence of ``s`` tokens, with ``d_attn`` = query heads × head
  dimension, so a forward pass costs ``4·L·d_attn·s²`` — **without** halving for the causal mask,
  as PaLM's ``6N + 12·L·H·Q·T`` and the MFU figures published with it count it.
- **Forward** = ``2·N·tokens + 4·L·d_attn·Σ s²``; **training** = forward + backward, the backward
  computing the activations' gradients (the forward's products again, and two per attention
  product) and the trained weights' gradients: ``2·N + 2·N_trained`` per token and
  ``8·L·d_attn·Σ s²``. With every weight trained that is the literature's ``6N`` per token plus
  ``12·L·d_attn·s`` (PaLM's attention term); with LoRA (``N_trained`` = the adapters) the frozen
  weights cost ``4N``, since no gradient of theirs is computed.
- **Decoding** with a key/value cache: the prompt's forward pass (its head at the last position
  only), then each further token through the model on its own — ``2·N`` (body and head) plus the
  attention over the ``c`` positions it sees, ``4·L·d_attn·c``.

Only real tokens count: a padded position is computation the hardware did, not the model's
(activation checkpointing's recomputation is not counted either: this is MFU, not HFU). The formulas
are exact for what they count: ``torch.utils.flop_counter`` on a model with eager attention gives
the same numbers (``tests/models/test_flops.py``). Sliding-window attention is counted as full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """What a model's FLOPs depend on. ``body`` / ``head``: matrix-product parameters of the blocks
    and of the language-model output layer (0 for a model without one); ``body_trained`` /
    ``head_trained``: those of them that train; ``layers`` and ``attention_width`` (query heads ×
    head dimension) for the attention term."""

    body: int
    head: int
    body_trained: int
    head_trained: int
    layers: int
    attention_width: int


@dataclass(frozen=True)
class Tokens:
    """Real tokens of some sequences passed through a model: ``body`` through the blocks,
    ``squares`` = Σ s² over the sequences' lengths s (the attention term), ``head`` the positions
    whose logits the output layer computes."""

    body: int = 0
    squares: int = 0
    head: int = 0

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(self.body + other.body, self.squares + other.squares, self.head + other.head)

    @classmethod
    def of(cls, lengths: Sequence[int], head: int) -> Tokens:
        """Sequences of the given real ``lengths``, with ``head`` positions through the output layer."""
        return cls(sum(lengths), sum(s * s for s in lengths), head)

    @classmethod
    def from_masks(cls, attention_mask: torch.Tensor, head_mask: torch.Tensor) -> Tokens:
        """From a batch's masks: ``attention_mask`` (B, L) marks each row's real tokens, ``head_mask``
        (B, T) the positions whose logits are computed (a rollout's response tokens)."""
        lengths = attention_mask.sum(1).long()
        return cls(int(lengths.sum()), int((lengths * lengths).sum()), int(head_mask.sum()))


def model_shape(model: torch.nn.Module) -> ModelShape:
    """A model's :class:`ModelShape`, from its live parameters (sharded ones count their global size,
    LoRA adapters count as the matrices they are) and its config's layers and attention heads."""
    out = getattr(model, "get_output_embeddings", None)
    head_module = out() if out is not None else None
    head_ids = {id(p) for p in head_module.parameters()} if head_module is not None else set()
    lookups = {
        id(p)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    body = head = body_trained = head_trained = 0
    for p in model.parameters():  # each shared (tied) parameter once
        if p.dim() < 2:
            continue
        n = p.numel()
        if id(p) in head_ids:
            head += n
            head_trained += n if p.requires_grad else 0
        elif id(p) not in lookups:
            body += n
            body_trained += n if p.requires_grad else 0
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    head_dim = getattr(cfg, "head_dim", None) or (
        getattr(cfg, "hidden_size", 0) // heads if heads else 0
    )
    return ModelShape(body, head, body_trained, head_trained, layers, heads * int(head_dim))


def _attention(shape: ModelShape, squares: int) -> int:
    return 4 * shape.layers * shape.attention_width * squares


def forward_flops(shape: ModelShape, tokens: Tokens) -> int:
    """A forward pass: ``2·N`` per token (the head's on ``tokens.head`` positions) plus attention."""
    return (
        2 * shape.body * tokens.body
        + 2 * shape.head * tokens.head
        + _attention(shape, tokens.squares)
    )


def train_flops(shape: ModelShape, tokens: Tokens) -> int:
    """A forward and backward pass: the forward, its products again for the activations' gradients
    (twice the attention's), and ``2·N_trained`` per token for the weights' gradients — ``6N`` per
    token and three times the attention when every weight trains."""
    weight_grads = 2 * shape.body_trained * tokens.body + 2 * shape.head_trained * tokens.head
    activation_grads = forward_flops(shape, tokens) + _attention(shape, tokens.squares)
    return forward_flops(shape, tokens) + activation_grads + weight_grads


def generate_flops(
    shape: ModelShape, prompt_lengths: Sequence[int], response_lengths: Sequence[int]
) -> int:
    """Sampling ``response_lengths[i]`` tokens after a prompt of ``prompt_lengths[i]`` real tokens,
    with a key/value cache: the prompt's forward pass (logits at its last position only, which give
    the first token), then each of the other n − 1 tokens through the model alone, attending to the
    prompt and the tokens before it and itself (c = p + j for the j-th, j = 1 … n − 1)."""
    total = 0
    for p, n in zip(prompt_lengths, response_lengths, strict=True):
        p, n = int(p), int(n)
        if n == 0:
            continue
        total += forward_flops(shape, Tokens(body=p, squares=p * p, head=1))
        steps = n - 1
        total += (2 * shape.body + 2 * shape.head) * steps
        total += 4 * shape.layers * shape.attention_width * (steps * p + steps * (steps + 1) // 2)
    return total
