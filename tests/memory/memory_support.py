"""The tiny model and GRPO set-up the planner's tests size by hand (tests/test_memory_methods.py's
tiny Llama): V 100, h 64, 3 layers, 4 heads and 2 KV heads of 16 (kv width 32), I 256, untied,
N(lm) = 197,568 counted by hand there; GRPO with 4 prompts x 2 responses on one device (B = 8
sequences) of P = 16 prompt + T = 16 response tokens, float32, fused log-probabilities."""

from __future__ import annotations

from proximal import memory
from proximal.memory.budget import ModelSpec, Setup
from proximal.models.tiny import tiny_config

V, H, L, KV = 100, 64, 3, 32  # and I = 256
N_LM = 197_568
B, P, T = 8, 16, 16


def tiny_arch():
    return memory.architecture_from_config(
        tiny_config("llama", V, hidden=H, layers=L, heads=4, kv_heads=2).to_dict()
    )


def grpo_setup(arch, **kw) -> Setup:
    """The GRPO set-up above on ``arch``; ``kw`` replaces any field."""
    base = dict(
        actor=ModelSpec.of(arch, "lm"),
        method="grpo",
        precision="32-true",
        batch=4,
        group_size=2,
        prompt_len=P,
        response_len=T,
        micro_batch=2,
        logprobs="fused",
    )
    return Setup(**{**base, **kw})
