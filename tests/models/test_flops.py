"""Model FLOPs (proximal.models.flops): the parameter counts of tiny models written out by hand from
their configs, the forward / training / decode formulas on those numbers, and the same counts from
torch's own FLOP counter on a model with eager attention (which computes every product explicitly,
so the counter sees the attention's two batched products as well as every linear layer)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from proximal.models.flops import (
    ModelShape,
    Tokens,
    forward_flops,
    generate_flops,
    model_shape,
    train_flops,
)
from proximal.models.tiny import tiny_config

V = 40  # vocabulary of the test models


def llama(kv_heads: int = 2, **kw):
    """A tiny Llama: hidden 32, 2 layers, 4 query heads of 8, ``kv_heads`` key/value heads, MLP 128."""
    torch.manual_seed(0)
    cfg = tiny_config("llama", V, hidden=32, layers=2, heads=4, kv_heads=kv_heads, **kw)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


# Written out from the config (hidden d = 32, 4 heads × 8 = 32 query width, 2 key/value heads × 8 = 16,
# intermediate 128, V = 40, 2 layers), not from the code's formula:
#   attention q 32·32 + k 32·16 + v 32·16 + o 32·32 = 1024 + 512 + 512 + 1024 = 3072
#   MLP gate, up, down: 3 · 32·128                                               = 12288
#   per layer 15360; two layers: body = 30720. Norm gains are vectors; the embedding is a lookup.
#   head: 40 · 32 = 1280. attention width = 4 · 8 = 32.
LLAMA = ModelShape(
    body=30720, head=1280, body_trained=30720, head_trained=1280, layers=2, attention_width=32
)


def test_tiny_llama_shape_by_hand():
    assert model_shape(llama()) == LLAMA


def test_tiny_llama_flops_by_hand():
    """Two sequences of 5 and 3 real tokens, the head on 4 positions: tokens 8, Σ s² = 25 + 9 = 34."""
    t = Tokens.of([5, 3], head=4)
    assert t == Tokens(body=8, squares=34, head=4)
    # forward: 2·30720·8 + 2·1280·4 + 4·2·32·34 = 491520 + 10240 + 8704
    assert forward_flops(LLAMA, t) == 510464
    # training, every weight trained: 6·30720·8 + 6·1280·4 + 12·2·32·34 = 1474560 + 30720 + 26112
    assert train_flops(LLAMA, t) == 1531392
    # only the head frozen: its weight gradient (2·1280·4 = 10240) is not computed
    frozen_head = ModelShape(30720, 1280, 30720, 0, 2, 32)
    assert train_flops(frozen_head, t) == 1531392 - 10240


def test_decode_flops_by_hand():
    """A prompt of 3 tokens, 3 tokens sampled: the prompt's forward with the head at its last
    position gives the first; the second and third go through alone, seeing 4 and 5 positions."""
    prefill = 2 * 30720 * 3 + 2 * 1280 * 1 + 4 * 2 * 32 * 3 * 3
    step = 2 * 30720 + 2 * 1280
    attend = 4 * 2 * 32 * (4 + 5)
    assert generate_flops(LLAMA, [3], [3]) == prefill + 2 * step + attend
    assert generate_flops(LLAMA, [3, 7], [3, 0]) == prefill + 2 * step + attend  # nothing sampled
    assert generate_flops(LLAMA, [3], [1]) == prefill  # one token: the prompt's pass alone


def test_gqa_gpt2_tied_and_classifier_shapes_by_hand():
    # one key/value head: k and v are 32·8 each → per layer 1024 + 256 + 256 + 1024 + 12288 = 14848
    assert model_shape(llama(kv_heads=1)).body == 2 * 14848
    # GPT-2, head tied to the token embedding: c_attn 32·96, attn c_proj 32·32, c_fc 32·128, mlp
    # c_proj 128·32 = 3072 + 1024 + 4096 + 4096 = 12288 per layer; learned positions are a lookup;
    # the tied head is counted once, as the head (its product is computed either way).
    cfg = tiny_config("gpt2", V, hidden=32, layers=2, heads=4)
    cfg.tie_word_embeddings = True
    gpt2 = AutoModelForCausalLM.from_config(cfg)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert model_shape(gpt2) == ModelShape(24576, 1280, 24576, 1280, 2, 32)
    # a one-label classifier: no language-model head; its 32·1 score is in the body
    rm = AutoModelForSequenceClassification.from_config(
        tiny_config("llama", V, hidden=32, layers=2, heads=4, kv_heads=2, num_labels=1)
    )
    assert model_shape(rm) == ModelShape(30720 + 32, 0, 30720 + 32, 0, 2, 32)


def test_lora_trains_only_its_adapters():
    """Rank-4 LoRA on q (32 → 32: A 4·32 + B 32·4 = 256) and v (32 → 16: A 4·32 + B 16·4 = 192):
    448 per layer, 896 trained in two layers; the base weights are frozen (and not counted trained)."""
    from peft import LoraConfig, get_peft_model  # lazy: peft is needed by this test only

    model = get_peft_model(
        llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    assert model_shape(model) == ModelShape(30720 + 896, 1280, 896, 0, 2, 32)


def counted(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def test_forward_and_training_agree_with_torchs_flop_counter():
    """One unpadded sequence of 7 tokens, logits at every position: torch counts 2·N·s for the linear
    layers and 4·L·d·s² for eager attention's two batched products in forward, and three times
    that with the backward of every weight (the embedding's gradient is a scatter, not a product)."""
    model, s = llama(), 7
    ids = torch.randint(4, V, (1, s), generator=torch.Generator().manual_seed(0))
    t = Tokens.of([s], head=s)
    with torch.no_grad():
        assert counted(lambda: model(input_ids=ids, use_cache=False)) == forward_flops(LLAMA, t)
    assert counted(lambda: model(input_ids=ids, use_cache=False).logits.sum().backward()) == (
        train_flops(LLAMA, t)
    )


def test_decode_agrees_with_torchs_flop_counter():
    """``generate`` with its key/value cache, 5 prompt tokens, exactly 4 sampled."""
    model, p, n = llama(), 5, 4
    ids = torch.randint(4, V, (1, p), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        flops = counted(
            lambda: model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=1,
            )
        )
    assert flops == generate_flops(LLAMA, [p], [n])


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_other_architectures_agree_with_torchs_flop_counter(arch):
    """GPT-2 (Conv1D layers, learned positions) and Qwen2 (q/k/v biases: vectors, not counted —
    the counter does not count a bias either)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, V, hidden=32, layers=2, heads=4), attn_implementation="eager"
    )
    s = 6
    ids = torch.randint(4, V, (1, s), generator=torch.Generator().manual_seed(2))
    t = Tokens.of([s], head=s)
    assert counted(lambda: model(input_ids=ids, use_cache=False).logits.sum().backward()) == (
        train_flops(model_shape(model), t)
    )


def test_tokens_from_masks():
    """Rows of 3 + 2 and 1 + 3 real tokens (left-padded prompts, right-padded responses)."""
    prompt = torch.tensor([[1, 1, 1], [0, 0, 1]])
    response = torch.tensor([[True, True, False], [True, True, True]])
    t = Tokens.from_masks(torch.cat([prompt.bool(), response], 1).long(), response)
    assert t == Tokens(body=9, squares=25 + 16, head=5)
    assert t + Tokens(1, 1, 1) == Tokens(10, 42, 6)


def test_lora_counts_every_layers_input_gradient():
    """With LoRA, torch skips the gradients nothing needs: below the first adapter, the first layer's
    input (the frozen embedding's output) needs none — not through q, k, v's frozen weights (1024 +
    512 + 512) or the adapters' A factors (2 · 128), nor through K in Q·Kᵀ (k is frozen there:
    2·s²·32). The count charges them (every layer's input gradient, as a fully trained model needs):
    more than torch's by exactly that, at most one layer's frozen share."""
    from peft import LoraConfig, get_peft_model  # lazy: peft is needed by this test only

    model = get_peft_model(
        llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    s = 7
    ids = torch.randint(4, V, (1, s), generator=torch.Generator().manual_seed(3))
    torch_count = counted(lambda: model(input_ids=ids, use_cache=False).logits.sum().backward())
    ours = train_flops(model_shape(model), Tokens.of([s], head=s))
    assert ours - torch_count == 2 * (1024 + 512 + 512 + 2 * 128) * s + 2 * s * s * 32
