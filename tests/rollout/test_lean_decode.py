"""proximal.rollout.decode: the lean decode step computes the model's own next-token logits.

The reference is not the lean step's own arithmetic but the model's: a full forward of the whole
sequence (no cache at all), and the Hugging Face cached decode the engine otherwise runs. Each
architecture it accepts is checked with left padding, grouped-query attention and, for Qwen2,
projection biases, both with the float32 oneDNN products (q/k/v and gate/up fused into one
product each) and with torch's own. A model it does not accept must fall back, with the reason.
"""

from __future__ import annotations

import pytest
import torch
from lean_support import V, prompts, tiny_lm
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from proximal.models import kernels
from proximal.models.heads import position_ids_from_mask
from proximal.rollout import decode
from proximal.rollout.engine import HFEngine, SamplingParams


def _lean_logits(model, ids, mask, continuation):
    """The lean decoder's logits after each token of ``continuation`` (B, T), teacher-forced. (B, T, V)."""
    with torch.no_grad(), kernels.packed_weights(model, rows=ids.shape[0]):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=True,
        )
        lean = decode.LeanDecoder.start(model, out.past_key_values, mask, continuation.shape[1] + 1)
        assert lean is not None
        fused = [w is not None for w in lean.qkv + lean.gate_up]
        position = mask.sum(1, keepdim=True)
        got = []
        for t in range(continuation.shape[1]):
            got.append(lean.step(continuation[:, t], position))
            position = position + 1
    return torch.stack(got, 1), fused


def _full_logits(model, ids, mask, continuation):
    """Logits of one forward over prompt + continuation, no cache: the model's own answer. (B, T, V)."""
    full_ids = torch.cat([ids, continuation], 1)
    full_mask = torch.cat([mask, torch.ones_like(continuation)], 1)
    with torch.no_grad():
        logits = model(
            input_ids=full_ids,
            attention_mask=full_mask,
            position_ids=position_ids_from_mask(full_mask),
        ).logits
    P = ids.shape[1]
    return logits[:, P:]


ARCHS = [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {"num_key_value_heads": 4}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"attn": "eager"}),
    ("qwen3", {"attn": "eager"}),
]


@pytest.mark.parametrize("matmul", ["onednn", "blas"])
@pytest.mark.parametrize(
    "arch,extra",
    ARCHS,
    ids=[
        f"{a}-{'-'.join(map(str, e.values())) if 'attn' in e else '-'.join(e) or 'gqa'}"
        for a, e in ARCHS
    ],
)
def test_lean_step_gives_the_models_own_logits(arch, extra, matmul, tmp_path, cpu_matmul):
    if matmul == "onednn" and kernels._OP is None:
        pytest.skip("this torch has no oneDNN linear")
    assert cpu_matmul(matmul)[0] == matmul
    model = tiny_lm(arch, tmp_path, **extra)
    kernels.use_onednn_linears(model)
    assert decode.unsupported(model) is None
    ids, mask = prompts()
    continuation = torch.randint(
        3, V, (ids.shape[0], 9), generator=torch.Generator().manual_seed(2)
    )
    got, fused = _lean_logits(model, ids, mask, continuation)
    want = _full_logits(model, ids, mask, continuation)
    assert want.abs().max() > 1.0  # logits of a size where a wrong rotation or mask would show
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert fused == [matmul == "onednn"] * len(fused)  # every layer's products stacked, or none


def test_a_wrong_position_or_a_missed_pad_is_seen(tmp_path):
    """The check above can fail: a shifted rotary position or padding the mask attends to changes the
    logits by far more than its tolerance."""
    model = tiny_lm("llama", tmp_path)
    ids, mask = prompts()
    continuation = torch.randint(
        3, V, (ids.shape[0], 4), generator=torch.Generator().manual_seed(2)
    )
    want = _full_logits(model, ids, mask, continuation)
    with torch.no_grad():

        def prompt_cache():  # each decoder empties the cache it starts from
            return model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids_from_mask(mask),
                use_cache=True,
            ).past_key_values

        lean = decode.LeanDecoder.start(model, prompt_cache(), mask, 5)
        shifted = lean.step(continuation[:, 0], mask.sum(1, keepdim=True) + 1)
        lean = decode.LeanDecoder.start(model, prompt_cache(), mask, 5)
        lean.attn_mask[:] = True  # attend to the pads too
        unmasked = lean.step(continuation[:, 0], mask.sum(1, keepdim=True))
    assert (shifted - want[:, 0]).abs().max() > 1e-2
    assert (unmasked[1] - want[1, 0]).abs().max() > 1e-2  # row 1 has 3 pads
    torch.testing.assert_close(unmasked[0], want[0, 0], rtol=0, atol=2e-5)  # row 0 has none


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_engine_samples_the_same_tokens_either_way(arch, tmp_path, lean_steps):
    """Sampling with the lean step and with the model's own forward: the same tokens for every row, at
    a temperature with top-p and a stop token, and the lean step ran at every token but the first."""
    model = tiny_lm(arch, tmp_path)
    kernels.use_onednn_linears(model)
    steps = lean_steps
    ids, mask = prompts()
    ids, mask = ids.repeat(4, 1), mask.repeat(4, 1)  # 24 rows, each with its own seed
    params = SamplingParams(max_new_tokens=16, stop_token_ids=(1, 5), temperature=0.8, top_p=0.95)
    lean = HFEngine(model, 0).generate(ids, mask, list(range(24)), params)
    assert steps[0] == lean.shape[1] - 1
    plain = HFEngine(model, 0, lean_decode=False).generate(ids, mask, list(range(24)), params)
    assert steps[0] == lean.shape[1] - 1  # the model's own forward this time
    assert lean.shape == plain.shape and torch.equal(lean, plain)


def test_under_autocast_the_tokens_are_the_models_own(tmp_path, lean_steps):
    """bf16-mixed decodes under bfloat16 autocast with eager attention (models/parallel.py): the
    lean step calls the same functions in the same dtypes, so it samples the same tokens."""
    steps = lean_steps
    model = tiny_lm("llama", tmp_path, attn="eager")
    model._proximal_autocast = torch.bfloat16  # what prepare_trained sets for bf16-mixed
    ids, mask = prompts()
    ids, mask = ids.repeat(4, 1), mask.repeat(4, 1)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(1,), temperature=1.0)
    engine = HFEngine(model, 0)
    assert engine.lean_reason() is None
    lean = engine.generate(ids, mask, list(range(24)), params)
    assert steps[0] == lean.shape[1] - 1 > 0
    plain = HFEngine(model, 0, lean_decode=False).generate(ids, mask, list(range(24)), params)
    assert torch.equal(lean, plain)


def _cached_logits(model, ids, mask, continuation):
    """The model's own decode with its DynamicCache after each token of ``continuation``, teacher-forced.
    (B, T, V)."""
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            cache=DynamicCache(config=model.config),
            use_cache=True,
        )
        m, pos, want = mask, mask.sum(1, keepdim=True), []
        for t in range(continuation.shape[1]):
            m = torch.cat([m, m.new_ones(m.shape[0], 1)], 1)
            out = model(
                input_ids=continuation[:, t : t + 1],
                attention_mask=m,
                position_ids=pos,
                cache=out.past_key_values,
                use_cache=True,
            )
            want.append(out.logits[:, -1])
            pos = pos + 1
    return torch.stack(want, 1)


def test_the_hf_cached_decode_agrees_too(tmp_path):
    """Against the engine's other path step by step: the model's forward with its DynamicCache."""
    model = tiny_lm("qwen2", tmp_path)
    ids, mask = prompts()
    continuation = torch.randint(
        3, V, (ids.shape[0], 6), generator=torch.Generator().manual_seed(3)
    )
    got, _ = _lean_logits(model, ids, mask, continuation)
    torch.testing.assert_close(
        got, _cached_logits(model, ids, mask, continuation), rtol=0, atol=2e-5
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_under_autocast_the_buffers_are_bfloat16_and_the_logits_the_cached_decodes(
    attn, tmp_path, cpu_matmul
):
    """Under bfloat16 autocast (bf16-mixed) the key and value buffers hold bfloat16 — the attention
    would cast the cache to it anyway — and the products are the packed bfloat16 copies: the logits
    are still those of the model's own cached decode under autocast, whose cache stays float32.
    Where this CPU has no oneDNN bfloat16 product (AVX2 only: kernels.packs_bfloat16), nothing is
    packed and the products are autocast's own — the logits the same."""
    cpu_matmul("onednn")
    model = tiny_lm("llama", tmp_path, attn=attn)
    kernels.use_onednn_linears(model)
    ids, mask = prompts()
    continuation = torch.randint(
        3, V, (ids.shape[0], 6), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, fused = _lean_logits(model, ids, mask, continuation)
        want = _cached_logits(model, ids, mask, continuation)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=True,
        )
        assert out.past_key_values.layers[0].keys.dtype == torch.float32  # the model's own cache
        lean = decode.LeanDecoder.start(model, out.past_key_values, mask, 2)
        assert {b.dtype for b in lean.keys + lean.values} == {torch.bfloat16}
    assert fused == [kernels.packs_bfloat16() is None] * len(fused)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)


def test_lora_and_activation_checkpointing_keep_the_lean_step(tmp_path):
    """A LoRA actor (peft's layers in place of the projections: no fused products, the adapters
    applied) and a model whose layers are wrapped for activation checkpointing decode the lean way."""
    from proximal.models.parallel import apply_activation_checkpointing
    from proximal.models.policy import lora_config, with_adapters

    model = tiny_lm("llama", tmp_path)
    lora = with_adapters(
        model, lora_config("CAUSAL_LM", r=4, alpha=8, target_modules=["all-linear"])
    ).eval()
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the output (lora_B starts at zero)
    kernels.use_onednn_linears(lora)
    assert decode.unsupported(lora) is None
    ids, mask = prompts()
    continuation = torch.randint(
        3, V, (ids.shape[0], 5), generator=torch.Generator().manual_seed(4)
    )
    got, fused = _lean_logits(lora, ids, mask, continuation)
    assert not any(fused)
    want = _full_logits(lora, ids, mask, continuation)
    with lora.disable_adapter():
        base = _full_logits(lora, ids, mask, continuation)
    assert (want - base).abs().max() > 1e-1  # the adapters matter
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)

    wrapped = tiny_lm("llama", tmp_path)
    apply_activation_checkpointing(wrapped)
    assert decode.unsupported(wrapped) is None
    got, _ = _lean_logits(wrapped, ids, mask, continuation)
    torch.testing.assert_close(
        got, _full_logits(wrapped, ids, mask, continuation), rtol=0, atol=2e-5
    )


def test_models_it_does_not_take_say_why_and_decode_their_own_way(tmp_path):
    gpt2 = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    )
    assert "GPT2LMHeadModel is not one of" in decode.unsupported(gpt2)
    assert HFEngine(gpt2, 0).lean_reason() == decode.unsupported(gpt2)

    eager = tiny_lm("llama", tmp_path)
    eager.config._attn_implementation = "flash_attention_2"  # its masks have another form
    assert "attention implementation 'flash_attention_2'" in decode.unsupported(eager)

    sliding = tiny_lm(
        "mistral", tmp_path, sliding_window=4
    )  # narrower than a 7-token prompt: it acts
    assert decode.unsupported(sliding) is None
    ids, mask = prompts()
    with torch.no_grad():
        out = sliding(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=True,
        )
    assert decode.LeanDecoder.start(sliding, out.past_key_values, mask, 4) is None

    dropout = tiny_lm("llama", tmp_path, attention_dropout=0.1)
    assert decode.unsupported(dropout) is None  # eval mode: no dropout acts
    assert decode.unsupported(dropout.train()) == "attention dropout in train mode"

    class Custom(type(eager)):  # a user's subclass may change forward: not taken
        pass

    eager.__class__ = Custom
    assert "Custom is not one of" in decode.unsupported(eager)

    llama = tiny_lm("llama", tmp_path)
    assert HFEngine(llama, 0, lean_decode=False).lean_reason() == "rollout.lean_decode is false"
    assert HFEngine(llama, 0).lean_reason() is None

    # The sliding-window model still samples (its own forward at every token).
    out = HFEngine(sliding, 0).generate(
        ids, mask, list(range(6)), SamplingParams(max_new_tokens=5, stop_token_ids=(1,))
    )
    assert out.shape[0] == 6 and 1 <= out.shape[1] <= 5


def test_a_cache_of_another_shape_is_declined(tmp_path):
    model = tiny_lm("llama", tmp_path)
    ids, mask = prompts()
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=True,
        )
    assert decode.LeanDecoder.start(model, object(), mask, 4) is None
    assert decode.LeanDecoder.start(model, out.past_key_values, mask[:, 1:], 4) is None  # P differs
    prompt_keys = [layer.keys.clone() for layer in out.past_key_values.layers]
    assert all(
        layer.keys is not None for layer in out.past_key_values.layers
    )  # a declined cache is intact
    lean = decode.LeanDecoder.start(model, out.past_key_values, mask, 1)
    # The prompt's keys moved into the buffers (P of P + 1 positions); the prompt's cache let them go.
    assert all(layer.keys is None and layer.values is None for layer in out.past_key_values.layers)
    for kept, buf in zip(prompt_keys, lean.keys):
        assert buf.shape[2] == ids.shape[1] + 1 and torch.equal(buf[:, :, : ids.shape[1]], kept)
    with torch.no_grad():
        lean.step(ids[:, 0], mask.sum(1, keepdim=True))
        with pytest.raises(RuntimeError, match="more tokens than"):
            lean.step(ids[:, 0], mask.sum(1, keepdim=True) + 1)
