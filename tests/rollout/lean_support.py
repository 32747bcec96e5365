"""Tiny causal LMs and left-padded prompts for the rollout tests: built from a config, saved and
loaded back through ``from_pretrained`` (the path a user's checkpoint takes); nothing downloaded."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

V = 97


def tiny_lm(arch: str, tmp_path, attn: str | None = None, **extra) -> torch.nn.Module:
    """A tiny randomly initialised causal LM, saved and loaded back through ``from_pretrained``
    (with the attention implementation ``attn``, else transformers' default, "sdpa")."""
    kw = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kw["head_dim"] = 16
    kw.update(extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw))
    with (
        torch.no_grad()
    ):  # larger weights than the initialiser's, so the logits are far from uniform
        for p in model.parameters():
            p.mul_(3.0) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / arch)
    kw = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_pretrained(tmp_path / arch, **kw).eval()


def prompts(B: int = 6, P: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    for b, pad in enumerate([0, 3, 1, 0, 5, 2][:B]):  # left padding of different lengths
        mask[b, :pad] = 0
        ids[b, :pad] = 0
    return ids, mask
