"""The vllm rollout engine (issue 41) against the trainer's own model: greedy ids equal to the hf
engine's, sampled tokens' μ equal to the trainer's log-probabilities, the engine equal to the policy
after several updates (and a planted stale push caught), seeds that survive a resume and a different
batch layout, and the trainer's threads and memory policy left as they were.

vLLM takes over process-wide state when it starts (torch.distributed with a world of one, the thread
count setter, the NUMA policy), so these tests carry the ``vllm`` marker and run in their own pytest
process in ``.venv-vllm`` (``make test-vllm``), never beside the main suite's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (make test-vllm builds .venv-vllm)"
)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from proximal.models.tiny import build_tiny_causal_lm  # noqa: E402
from proximal.rollout import vllm as vllm_engine  # noqa: E402
from proximal.rollout.engine import HFEngine, SamplingParams, filter_logits  # noqa: E402
from proximal.rollout.vllm import VLLMEngine, memory_policy  # noqa: E402

pytestmark = pytest.mark.vllm

KV = 32 << 20  # 32 MiB of KV cache: thousands of tokens at these shapes


@pytest.fixture
def engines():
    """Builds engines and closes each at the test's end (vLLM's parallel state is one per process:
    an engine collected during the next test would tear down that test's)."""
    built = []

    def build(model, pad: int = 0, **kw):
        built.append(VLLMEngine(model, pad, **{"kv_cache_bytes": KV, "max_model_len": 64, **kw}))
        return built[-1]

    yield build
    for engine in built:
        engine.close()


def _model(assets, arch: str, *, tied: bool = False, seed: int = 0):
    """A tiny float32 policy whose heads vLLM's CPU attention runs (head dimension 32)."""
    if arch == "llama":
        shape = dict(hidden=128, heads=4, kv_heads=2)
    else:
        shape = dict(hidden=64, heads=2)
    path = build_tiny_causal_lm(
        assets.root / f"vllm_{arch}_{seed}", assets.tokenizer, arch=arch, seed=seed, **shape
    )
    if not tied:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _prompts(n: int, seed: int = 0):
    """``n`` left-padded prompts of 2–9 tokens (BOS, then ids of the tiny vocabulary's characters):
    (ids, mask)."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        [2] + torch.randint(4, 12, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 9, (n,), generator=g)
    ]
    width = max(map(len, rows))
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    return ids, mask


def _policy_logprobs(model, sequences: list[list[int]], temperature: float = 1.0) -> list:
    """log softmax(z / τ) of each token after the first, from the trainer's own forward (float64
    softmax of its float32 logits)."""
    out = []
    with torch.no_grad():
        for s in sequences:
            z = model(torch.tensor([s])).logits[0, :-1].double() / temperature
            out.append(z.log_softmax(-1).gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_ids_equal_the_hf_engines_and_sampled_logprobs_equal_the_trainers(
    assets, engines, arch
):
    model = _model(assets, arch)
    pad, eos = assets.tokenizer.pad_token_id, assets.tokenizer.eos_token_id
    engine = engines(model, pad)
    ids, mask = _prompts(6)
    greedy = SamplingParams(max_new_tokens=12, stop_token_ids=(eos,), top_k=1)
    hf_ids = HFEngine(model, pad).generate(ids, mask, list(range(6)), greedy)
    v_ids = engine.generate(ids, mask, list(range(6)), greedy)
    assert torch.equal(v_ids, hf_ids)

    # Sampled at τ = 0.7: μ of each sampled token is the trainer's log softmax(z / τ) there.
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(eos,), temperature=0.7)
    got, mu = engine.generate(ids, mask, list(range(10, 16)), params, logprobs=True)
    sequences, lengths = [], []
    for b in range(6):
        row = got[b].tolist()
        n = next((j + 1 for j, t in enumerate(row) if t == eos), len(row))
        sequences.append(ids[b][mask[b]].tolist() + row[:n])
        lengths.append(n)
    ref = _policy_logprobs(model, sequences, temperature=0.7)
    for b in range(6):
        expected = ref[b][-lengths[b] :]
        assert torch.allclose(mu[b, : lengths[b]].double(), expected, atol=1e-5, rtol=0)
        assert (mu[b, lengths[b] :] == 0).all() and (got[b, lengths[b] :] == pad).all()


def test_top_p_and_top_k_logprobs_are_of_the_filtered_distribution(assets, engines):
    """μ under top-p/top-k is the log-probability under the truncated, renormalised distribution the
    token was drawn from: vLLM's processed log-probs, the contract of docs/rollout-correction.md."""
    model = _model(assets, "qwen2")
    eos = assets.tokenizer.eos_token_id
    engine = engines(model, assets.tokenizer.pad_token_id)
    ids, mask = _prompts(4, seed=1)
    params = SamplingParams(
        max_new_tokens=8, stop_token_ids=(eos,), temperature=0.8, top_p=0.7, top_k=20
    )
    got, mu = engine.generate(ids, mask, [1, 2, 3, 4], params, logprobs=True)
    with torch.no_grad():
        for b in range(4):
            row = got[b].tolist()
            n = next((j + 1 for j, t in enumerate(row) if t == eos), len(row))
            seq = ids[b][mask[b]].tolist() + row[:n]
            z = model(torch.tensor([seq])).logits[0, -n - 1 : -1].float() / 0.8
            lp = filter_logits(z, top_k=20, top_p=0.7).double().log_softmax(-1)
            expected = lp.gather(-1, torch.tensor(row[:n])[:, None]).squeeze(-1)
            assert torch.allclose(mu[b, :n].double(), expected, atol=1e-5, rtol=0)


def _perturbed(model, k: int) -> None:
    """k "updates": every parameter moved by a seeded random step."""
    g = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_the_engine_equals_the_policy_after_several_updates(assets, engines):
    model = _model(assets, "qwen2", tied=True)  # a tied lm_head: the tensor named_parameters drops
    engine = engines(model, assets.tokenizer.pad_token_id)
    sequences = [[2, 5, 9, 11, 4, 7, 8], [2, 6, 6, 10, 11]]
    for k in range(3):
        _perturbed(model, k)
        engine.after_update()
        got = engine.sequence_logprobs(sequences)
        for g, ref in zip(got, _policy_logprobs(model, sequences)):
            assert torch.allclose(torch.tensor(g, dtype=torch.float64), ref, atol=1e-5, rtol=0)
    assert engine.pushes == 3


def test_a_lora_policy_pushes_its_merged_weights(assets, engines):
    """LoRA: the engine takes W + s·BA of every adapted layer (the live weights never merged in
    place), so it equals the peft model's forward after its adapters trained."""
    from proximal.models.policy import with_lora

    model = with_lora(
        _model(assets, "qwen2"), "CAUSAL_LM", {"r": 4, "alpha": 8, "target_modules": ["all-linear"]}
    )
    engine = engines(model)
    sequences = [[2, 5, 9, 11, 4, 7, 8]]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # 0 at the start: the adapters do nothing until they train
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    base = [p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n]
    engine.after_update()
    got = torch.tensor(engine.sequence_logprobs(sequences)[0], dtype=torch.float64)
    ref = _policy_logprobs(model, sequences)[0]
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)
    with model.disable_adapter():  # the adapters matter here: without them the numbers differ
        assert (got - _policy_logprobs(model, sequences)[0]).abs().max() > 1e-3
    after = [p for n, p in model.named_parameters() if "base_layer" in n]
    assert all(torch.equal(a, b) for a, b in zip(base, after))


def _stale_pushes():
    every = vllm_engine.pushed_weights

    def without_lm_head(model):
        return ((n, t) for n, t in every(model) if n != "lm_head.weight")

    def named_parameters_only(model):  # what the peers iterate: drops the tied lm_head
        return ((n, p.detach()) for n, p in model.named_parameters())

    return {"without_lm_head": without_lm_head, "named_parameters": named_parameters_only}


@pytest.mark.parametrize("plant", ["without_lm_head", "named_parameters", "no_push"])
def test_a_stale_push_is_caught(assets, engines, monkeypatch, plant):
    """The control of the test above: each way a push can leave the engine behind the policy (a
    skipped tied weight, the peers' named_parameters, no push after an update) leaves the engine's
    log-probabilities far from the policy's."""
    model = _model(assets, "qwen2", tied=True)
    engine = engines(model, assets.tokenizer.pad_token_id)
    sequences = [[2, 5, 9, 11, 4, 7, 8]]
    engine.sequence_logprobs(sequences)  # the first push, as it should be
    if plant in ("without_lm_head", "named_parameters"):
        monkeypatch.setattr(vllm_engine, "pushed_weights", _stale_pushes()[plant])
    _perturbed(model, 7)
    if plant != "no_push":
        engine.after_update()
    got = torch.tensor(engine.sequence_logprobs(sequences)[0], dtype=torch.float64)
    ref = _policy_logprobs(model, sequences)[0]
    assert (got - ref).abs().max() > 1e-2


def test_the_engine_has_no_checkpoint_to_reload_from(assets, engines):
    """TRL's issue #5312: ``reload_weights`` without an iterator reloads the checkpoint from disk,
    silently discarding the pushed weights. The engine is built with dummy weights from the config
    alone, so that call has nothing to load and fails instead of sampling from stale weights."""
    engine = engines(_model(assets, "qwen2"))
    with pytest.raises(NotImplementedError, match="dummy"):
        engine.llm.collective_rpc("reload_weights")


def test_rows_sample_the_same_tokens_in_any_batch_layout_and_on_a_new_engine(assets, engines):
    """Each row draws with its own seed (row_seed): alone, in a batch, in reversed order, or from a
    second engine (a resumed run's), a row gets the same tokens and μ — on this CPU build; vLLM does
    not promise batch-invariant kernels in general (docs/engines.md)."""
    model = _model(assets, "llama")
    pad, eos = assets.tokenizer.pad_token_id, assets.tokenizer.eos_token_id
    engine = engines(model, pad)
    ids, mask = _prompts(6, seed=3)
    seeds = [(1 << 62) + 17 * i for i in range(6)]  # 63-bit, as row_seed gives
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(eos,))
    together, mu = engine.generate(ids, mask, seeds, params, logprobs=True)
    reversed_ids, reversed_mu = engine.generate(
        ids.flip(0), mask.flip(0), seeds[::-1], params, logprobs=True
    )
    assert torch.equal(reversed_ids.flip(0)[:, : together.shape[1]], together)
    for b in range(6):
        alone, alone_mu = engine.generate(
            ids[b : b + 1], mask[b : b + 1], [seeds[b]], params, logprobs=True
        )
        n = alone.shape[1]
        assert torch.equal(alone[0], together[b, :n])
        assert torch.equal(alone_mu[0], mu[b, :n])
    engine.close()  # one engine per process at a time (vLLM's parallel state)
    again = engines(model, pad)
    assert torch.equal(again.generate(ids, mask, seeds, params), together)


def test_the_trainers_threads_and_memory_policy_are_kept(assets, engines):
    torch.set_num_threads(2)
    before = memory_policy()
    engines(_model(assets, "qwen2"))
    assert torch.get_num_threads() == 2
    torch.set_num_threads(
        1
    )  # still a working setter (vLLM's CPU worker replaces it with a warning)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert memory_policy() == before


def test_a_head_dimension_the_cpu_kernel_does_not_run_is_one_line(assets, engines):
    model = AutoModelForCausalLM.from_pretrained(assets.policy("llama"))  # hidden 32, 2 heads: 16
    with pytest.raises(Exception) as info:
        engines(model, 0)
    assert "heads have dimension 16" in str(info.value) and "rollout.engine: hf" in str(info.value)


def test_a_grpo_run_on_a_policy_vllm_cannot_run_is_one_line_before_any_model_loads(
    assets, engines, tmp_path, capsys, monkeypatch
):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "trainers"))
    from grpo_support import grpo_config, grpo_main

    from proximal.trainers import grpo

    monkeypatch.setattr(grpo, "build_models", lambda *a, **k: pytest.fail("models were loaded"))
    cfg = grpo_config(assets.policy("llama"), assets.prompts, tmp_path / "run")  # head dim 16
    assert grpo_main(cfg, "--rollout.engine", "vllm") == 2
    err = capsys.readouterr().err
    assert "rollout.engine = vllm: the policy's attention heads have dimension 16" in err
    assert "Traceback" not in err


def test_an_engine_that_would_not_fit_is_one_line_before_vllm_starts(assets, engines):
    from proximal.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"rollout.kv_cache_gib: the vllm engine needs 1048576\.00 GiB"
    ):
        VLLMEngine(_model(assets, "qwen2"), 0, kv_cache_bytes=1 << 50, max_model_len=64)
