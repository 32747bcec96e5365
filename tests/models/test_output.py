"""The output layer as tensors and the one choice between the fused path and the logits path
(:mod:`proximal.models.output`).

Every head the fused path reads — untied, tied to the input embedding, with a bias, Gemma-2's
soft-capped logits, peft LoRA on the head (active, disabled, merged), bf16-mixed autocast — gives
the log-probabilities, entropies and gradients of the logits path on the same model, and every head
it cannot read gives a reason and falls back. Expected values come from the logits path
(:func:`proximal.models.heads.lm_logits` + :mod:`proximal.core.logprobs`), which shares no code with
the fused one past the model's own forward.

Tolerances: float32 round-off of two summation orders of the same products. Log-probabilities and
entropies (values of size 1–5) agree to 2e-6 + 1e-6 relative (a few dozen units of float32
round-off; observed ≤ 2.9e-6); gradients to 1e-4 of their largest entry (observed ≤ 2.4e-5, on a
LoRA factor deep in the backward; a wrong head gradient is off by order 1); bf16-mixed to 0.05
(bfloat16's 2⁻⁸ relative step on logits of size ~4, twice over).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from proximal.core.fused import linear_logprobs
from proximal.models import output
from proximal.models.loading import backbone
from proximal.models.output import (
    fused_problem,
    lm_hidden,
    models_token_kl,
    output_head,
    token_kl,
    token_logprobs,
)
from proximal.models.tiny import tiny_config
from proximal.train.sections import LOGPROBS

V, START, STOP = 40, 4, 11  # scored positions 4…10 of 12 input tokens
TOL, GRAD_TOL = 2e-6, 1e-4


def _llama(seed: int = 0, **config) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config("llama", V)
    for k, v in config.items():
        setattr(cfg, k, v)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _gemma2(cap: float) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "gemma2",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=cap,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def _batch():
    """Three rows of 12 tokens, the first left-padded by 3; the scored tokens' mask has padding
    (row 2's last two) and a hole (row 1, position 2)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, V, (3, 12), generator=g)
    att = torch.ones_like(ids)
    att[0, :3] = 0
    tokens = ids[:, START + 1 : STOP + 1]
    mask = torch.ones(tokens.shape, dtype=torch.bool)
    mask[2, -2:] = False
    mask[1, 2] = False
    return ids, att, tokens, mask


def _scores(model, path: str, entropy="trained", temperature=0.7):
    ids, att, tokens, mask = _batch()
    return token_logprobs(
        model,
        ids,
        att,
        START,
        STOP,
        tokens,
        mask=mask,
        temperature=temperature,
        entropy=entropy,
        path=path,
    )


def _grads(model, scores) -> dict[str, torch.Tensor]:
    """Gradients of a fixed random combination of the log-probabilities and entropies."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(scores.logprobs.shape, generator=g)
    loss = (w * scores.logprobs).sum() + (w.flip(0) * scores.entropy).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_paths_agree(model, *, tol=TOL, grad_tol=GRAD_TOL, temperature=0.7) -> dict:
    """The fused path's log-probabilities, entropies and gradients are the logits path's; returns
    the fused gradients."""
    fused = _scores(model, "fused", temperature=temperature)
    fused_grads = _grads(model, fused)
    logits = _scores(model, "logits", temperature=temperature)
    logits_grads = _grads(model, logits)
    _, _, _, mask = _batch()
    assert torch.equal(fused.logprobs[~mask], torch.zeros(int((~mask).sum())))
    torch.testing.assert_close(fused.logprobs, logits.logprobs, rtol=tol / 2, atol=tol)
    torch.testing.assert_close(fused.entropy, logits.entropy, rtol=tol / 2, atol=tol)
    assert fused_grads.keys() == logits_grads.keys() and fused_grads
    for name, g in fused_grads.items():
        scale = float(logits_grads[name].abs().max())
        assert float((g - logits_grads[name]).abs().max()) <= grad_tol * max(scale, 1e-12), name
    return fused_grads


# ----------------------------------------------------------------------------- heads the path reads


def test_an_untied_head_is_its_linear_weight():
    model = _llama()
    head = output_head(model)
    assert head.weight is model.lm_head.weight and head.bias is None
    assert head.softcap is None and head.matmul_dtype is None
    assert fused_problem(model) is None
    grads = assert_paths_agree(model)
    assert "lm_head.weight" in grads and "model.embed_tokens.weight" in grads


def test_a_tied_head_is_the_input_embedding_and_gets_both_gradients():
    model = _llama(tie_word_embeddings=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert output_head(model).weight is model.model.embed_tokens.weight
    assert_paths_agree(model)  # the shared parameter's gradient: the head's plus the embedding's


def test_a_head_with_a_bias():
    model = _llama()
    torch.manual_seed(3)
    head = torch.nn.Linear(32, V, bias=True)
    model.lm_head = head
    assert output_head(model).bias is head.bias
    grads = assert_paths_agree(model)
    assert float(grads["lm_head.bias"].abs().max()) > 0


def test_gemma2_soft_capping_applies_to_the_logits_not_the_hidden_states():
    cap = 0.5  # small, so capping changes every log-probability
    model = _gemma2(cap)
    head = output_head(model)
    assert head.softcap == cap and head.weight is model.lm_head.weight
    assert fused_problem(model) is None
    assert_paths_agree(model)
    ids, att, tokens, mask = _batch()
    with torch.no_grad():
        hidden, _ = lm_hidden(model, ids, att, START, STOP)
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        full = backbone(model)(input_ids=ids, attention_mask=att, position_ids=pos)
        # the final norm's output itself: larger than the cap, so never capped
        assert torch.equal(hidden, full.last_hidden_state[:, START:STOP])
        assert float(hidden.abs().max()) > cap
        capped = token_logprobs(model, ids, att, START, STOP, tokens, mask=mask).logprobs
        uncapped = linear_logprobs(hidden, head.weight, tokens, mask=mask)
    assert float((capped - uncapped).abs().max()) > 1e-2  # the cap is really applied


def test_lm_hidden_takes_the_positions_of_lm_logits_with_or_without_logits_to_keep(monkeypatch):
    model = _llama()
    ids, att, _, _ = _batch()
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = backbone(model)(input_ids=ids, attention_mask=att, position_ids=pos)
        want = want.last_hidden_state[:, START:STOP]
        got, head = lm_hidden(model, ids, att, START, STOP)
        assert torch.equal(got, want) and head.weight is model.lm_head.weight
        monkeypatch.setattr(output, "accepts_logits_to_keep", lambda m: False)
        sliced, _ = lm_hidden(model, ids, att, START, STOP)
    assert torch.equal(sliced, want)
    assert model.lm_head.__dict__.get("forward") is None  # the capture is gone


def test_bf16_mixed_runs_the_product_in_bfloat16():
    model = _llama()
    model._proximal_autocast = torch.bfloat16  # what prepare_trained sets for bf16-mixed
    assert output_head(model).matmul_dtype == torch.bfloat16
    assert fused_problem(model) is None
    assert_paths_agree(model, tol=5e-2, grad_tol=5e-2)


# ----------------------------------------------------------------------------- LoRA on the head


def _lora(model, **config):
    from peft import LoraConfig, get_peft_model

    config = {"lora_dropout": 0.0, **config}
    cfg = LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], **config
    )
    peft_model = get_peft_model(model, cfg)
    torch.manual_seed(4)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0; a trained adapter is not
            p.data.normal_(0, 0.3)
    return peft_model


def test_lora_on_the_head_folds_into_the_weight_and_trains_its_adapters():
    model = _lora(_llama())
    lm_head = model.base_model.model.lm_head
    a, b = lm_head.lora_A["default"].weight, lm_head.lora_B["default"].weight
    want = lm_head.base_layer.weight + (8 / 4) * b @ a  # W + (α/r)·B A, by hand
    torch.testing.assert_close(output_head(model).weight, want, rtol=0, atol=1e-7)
    assert fused_problem(model) is None
    grads = assert_paths_agree(model)
    head_adapters = [n for n in grads if "lm_head.lora_" in n]
    assert len(head_adapters) == 2 and all(float(grads[n].abs().max()) > 0 for n in head_adapters)
    assert any("q_proj.lora_" in n for n in grads)


def test_disabled_or_merged_adapters_leave_the_base_weight():
    model = _lora(_llama())
    base = model.base_model.model.lm_head.base_layer.weight
    with model.disable_adapter():  # the reference of a LoRA run
        assert output_head(model).weight is base
        with torch.no_grad():
            fused, logits = (_scores(model, p, entropy="logged") for p in ("fused", "logits"))
    torch.testing.assert_close(fused.logprobs, logits.logprobs, rtol=0, atol=TOL)
    with torch.no_grad():
        active = _scores(model, "fused", entropy=None).logprobs
    assert float((active - fused.logprobs).abs().max()) > 1e-3  # the adapters were really off
    model.merge_adapter()
    assert output_head(model).weight is base  # the merged weight: W + s·B A in place
    with torch.no_grad():
        merged = _scores(model, "fused", entropy=None).logprobs
        torch.testing.assert_close(merged, _scores(model, "logits", entropy=None).logprobs)
    torch.testing.assert_close(merged, active, rtol=0, atol=1e-5)
    model.unmerge_adapter()


def test_a_fully_trained_copy_of_the_head_is_read_through_peft():
    """peft's ``modules_to_save``: the head trains whole beside its frozen original."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _llama(),
        LoraConfig(
            task_type="CAUSAL_LM", r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]
        ),
    )
    wrapper = model.base_model.model.lm_head
    with torch.no_grad():
        wrapper.modules_to_save["default"].weight.add_(0.5)  # trained away from the original
    assert output_head(model).weight is wrapper.modules_to_save["default"].weight
    grads = assert_paths_agree(model)
    assert any("modules_to_save" in n and "lm_head" in n for n in grads)
    with model.disable_adapter():
        assert output_head(model).weight is wrapper.original_module.weight


# ----------------------------------------------------------------------------- heads it cannot read


@pytest.mark.parametrize(
    "config, says",
    [({"use_dora": True}, "Dora"), ({"lora_dropout": 0.1}, "dropout p = 0.1")],
)
def test_lora_variants_the_fused_path_does_not_fold_give_a_reason(config, says):
    model = _lora(_llama(), **config)
    reason = output_head(model)
    assert isinstance(reason, str) and says in reason and "lm_head" not in reason


class _ScaledHead(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight

    def forward(self, x):
        return 2 * torch.nn.functional.linear(x, self.weight)


class _ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_heads_that_are_not_linear_layers_give_a_reason():
    model = _llama()
    model.lm_head = _ScaledHead(model.lm_head)
    assert output_head(model) == "its output layer is a _ScaledHead, not a Linear layer"
    model.lm_head = _ScaledLinear(32, V, bias=False)
    assert output_head(model) == "its output layer is a _ScaledLinear, not a Linear layer"


def test_known_logit_transforms_and_a_missing_head_give_a_reason(monkeypatch):
    model = _llama()
    model.config.logit_scale = 0.0625  # Cohere's
    assert output_head(model) == (
        "its config's logit_scale = 0.0625 transforms the logits after the output layer"
    )
    model.config.logit_scale = 1.0  # the identity: nothing to do
    assert not isinstance(output_head(model), str)
    monkeypatch.setattr(model, "get_output_embeddings", lambda: None)
    assert "has no output embeddings" in output_head(model)


def test_an_unknown_logits_transform_is_caught_by_the_probe_and_falls_back(capsys):
    """A forward that rescales its logits after the output layer (here through a hook, as any
    architecture's own code could): the probe sees it, the path falls back to the logits, says so
    once, and the values are the logits path's."""
    model = _llama()

    def rescale(module, args, out):
        out.logits = out.logits * 3
        return out

    model.register_forward_hook(rescale)
    problem = fused_problem(model)
    assert problem is not None and "differ from its output layer's product" in problem
    with torch.no_grad():
        first = _scores(model, "fused", entropy="logged")
        again = _scores(model, "fused", entropy="logged")
        want = _scores(model, "logits", entropy="logged")
    assert torch.equal(first.logprobs, want.logprobs) and torch.equal(again.logprobs, want.logprobs)
    lines = [x for x in capsys.readouterr().out.splitlines() if "log-probabilities" in x]
    assert lines == [
        "proximal: log-probabilities of LlamaForCausalLM through the logits (train.logprobs: "
        f"fused cannot be used: {problem})"
    ]


def test_a_path_that_is_not_a_choice_is_refused():
    with pytest.raises(ValueError, match="'logit' is not one of fused, logits"):
        _scores(_llama(), "logit")
    assert LOGPROBS == output.LOGPROBS_PATHS  # train.logprobs' choices are the paths


# ----------------------------------------------------------------------------- the token KL


def test_token_kl_of_two_models_is_the_logits_paths():
    from proximal.core import token_kl as logits_kl
    from proximal.models.heads import lm_logits

    policy, ref = _llama(seed=0), _gemma2(cap=3.0)  # different heads, one vocabulary
    ids, att, _, mask = _batch()
    with torch.no_grad():
        want = logits_kl(
            lm_logits(policy, ids, att, START, STOP),
            lm_logits(ref, ids, att, START, STOP),
            0.7,
            mask=mask,
        )
        got = models_token_kl(policy, ref, ids, att, START, STOP, mask=mask, temperature=0.7)
        kept = token_logprobs(
            policy, ids, att, START, STOP, ids[:, START + 1 : STOP + 1], mask=mask, keep=True
        ).kept
        from_kept = token_kl(kept, ref, ids, att, START, STOP, mask=mask, temperature=0.7)
        via_logits = models_token_kl(
            policy, ref, ids, att, START, STOP, mask=mask, temperature=0.7, path="logits"
        )
    assert float(want[mask].min()) > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    torch.testing.assert_close(from_kept, want, rtol=0, atol=TOL)
    torch.testing.assert_close(via_logits, want, rtol=0, atol=TOL)


# ----------------------------------------------------------------------------- a replayed filter


@pytest.mark.parametrize("entropy", ["logged", "trained"])
def test_a_replayed_filter_takes_the_logits_path_with_one_note(entropy, capsys):
    """``filter`` (rollout.replay_filter): the log-probabilities are the filter's replay on the
    model's logits (:func:`proximal.core.filtered_logprobs_from_logits`), the full ones and the
    entropy the full softmax's; "fused" falls back to the logits, saying so once; gradients reach
    the model through both."""
    from proximal.core import filtered_logprobs_from_logits
    from proximal.models.heads import lm_logits

    model = _llama()
    ids, att, tokens, mask = _batch()

    def replay(path):
        return token_logprobs(
            model,
            ids,
            att,
            START,
            STOP,
            tokens,
            mask=mask,
            temperature=0.7,
            entropy=entropy,
            path=path,
            filter=(5, 0.8),
        )

    got, again, plain = replay("fused"), replay("logits"), _scores(model, "logits", entropy)
    with torch.no_grad():
        logits = lm_logits(model, ids, att, START, STOP)
        want, full = filtered_logprobs_from_logits(
            logits, tokens, 0.7, top_k=5, top_p=0.8, mask=mask
        )
    for s in (got, again):
        torch.testing.assert_close(s.logprobs, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(s.full_logprobs, plain.logprobs, rtol=0, atol=1e-6)
        torch.testing.assert_close(s.entropy, plain.entropy, rtol=0, atol=1e-6)
        assert s.unfiltered is s.full_logprobs
    assert bool((got.logprobs - got.full_logprobs)[mask].min() > 0)  # truncation: mass dropped
    assert plain.full_logprobs is None and plain.unfiltered is plain.logprobs
    assert got.logprobs.requires_grad and got.full_logprobs.requires_grad
    assert got.entropy.requires_grad == (entropy == "trained")
    lines = [x for x in capsys.readouterr().out.splitlines() if "log-probabilities" in x]
    assert lines == [
        "proximal: log-probabilities of LlamaForCausalLM through the logits (train.logprobs: "
        "fused cannot be used: rollout.replay_filter needs whole vocabulary rows for top-k/top-p)"
    ]
    # a filter that keeps everything is no filter: the fused path, no full_logprobs
    same = token_logprobs(
        model, ids, att, START, STOP, tokens, mask=mask, path="fused", filter=(0, 1.0)
    )
    assert same.full_logprobs is None
