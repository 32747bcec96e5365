"""train.compile: which models compile their blocks and why, and that a compiled block computes what the
eager one does, within float32 round-off, forward and backward, with and without gradients, at a second
sequence length (proximal.models.compiled)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from proximal.config import load_config, section
from proximal.models import compiled, kernels
from proximal.models.tiny import tiny_config
from proximal.rollout import decode
from proximal.rollout.engine import HFEngine, SamplingParams, bfloat16_copy
from proximal.train.records import compile_line
from proximal.train.sections import TrainSection


def _model(arch: str = "llama", hidden: int = 64, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny_config(arch, 97, hidden=hidden, layers=layers, heads=4)
    cfg._attn_implementation = "sdpa" if arch == "llama" else "eager"
    return AutoModelForCausalLM.from_config(cfg)


def test_blocks_are_the_stack_of_identical_layers():
    llama = _model()
    assert compiled.blocks(llama) is llama.model.layers
    gpt2 = _model("gpt2")
    assert compiled.blocks(gpt2) is gpt2.transformer.h
    assert compiled.blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())) is None


@pytest.mark.parametrize(
    "choice, kwargs, go, says",
    [
        ("eager", {}, False, "train.compile = eager"),
        ("blocks", {"hidden": 32}, True, "train.compile = blocks"),
        ("blocks", {"world_size": 2}, False, "several processes"),
        ("auto", {"steps": 1000}, True, "hidden size 256 ≥ 256: 1000 steps"),
        ("auto", {"steps": 3}, False, "hidden size 256 ≥ 256: 3 steps"),
        ("auto", {}, False, "the run's length is not known"),
        ("auto", {"steps": 3, "recorded": True}, True, "as the run being resumed recorded"),
        ("auto", {"steps": 1000, "recorded": False}, False, "as the run being resumed recorded"),
        ("auto", {"steps": 1000, "hidden": 255, "recorded": True}, False, "255 < 256"),
        ("blocks", {"steps": 3, "recorded": False}, True, "train.compile = blocks"),
        ("auto", {"hidden": 255}, False, "hidden size 255 < 256"),
        ("auto", {"hidden": None}, False, "hidden size None < 256"),
        ("auto", {"device_type": "cuda"}, False, "on cuda it is not measured"),
        ("auto", {"lora": True}, False, "LoRA adapters"),
        ("auto", {"activation_checkpointing": True}, False, "activation checkpointing"),
        ("auto", {"world_size": 4}, False, "several processes"),
    ],
)
def test_decide(choice, kwargs, go, says):
    base = dict(
        device_type="cpu", world_size=1, hidden=256, lora=False, activation_checkpointing=False
    )
    got, why = compiled.decide(choice, **{**base, **kwargs})
    assert got is go
    assert why.startswith(f"train.compile = {choice}") and says in why


def test_auto_compiles_only_where_the_run_repays_compiling():
    """steps × STEP_SAVING_S × hidden / 256 against COMPILE_COST_S (issue 37): at hidden 256 the
    saving is 0.1 s a step against 75 s, so 750 steps are not enough and 751 are; at hidden 512 the
    saving doubles and 376 steps are enough. A 3-step smoke run never compiles."""
    assert (compiled.STEP_SAVING_S, compiled.COMPILE_COST_S) == (0.1, 75.0)
    assert compiled.pays(750, 256)[0] is False and compiled.pays(751, 256)[0] is True
    assert compiled.pays(375, 512)[0] is False and compiled.pays(376, 512)[0] is True
    assert compiled.pays(3, 256) == (
        False,
        "3 steps × about 0.1 s saved a step at hidden size 256 = 0.3 s ≤ about 75 s of compiling",
    )
    assert compiled.pays(None, 4096)[0] is False


@dataclasses.dataclass
class _Config:
    train: TrainSection = section(TrainSection)

    def validate(self) -> list[str]:
        return self.train.problems()


@pytest.mark.parametrize("spelled", ["false", "off", "False", "OFF", False])
def test_false_and_off_are_eager(spelled):
    """``train.compile: false`` / ``off`` (YAML reads both as a boolean) and the CLI's strings."""
    assert compiled.normalize(spelled) == "eager"
    assert load_config(_Config, overrides={"train.compile": spelled}).train.compile == "eager"
    built = _Config()
    built.train.compile = spelled  # a config built in code (the Python API)
    assert built.validate() == []


def test_a_smoke_run_of_a_hidden_256_model_stays_eager_under_auto(monkeypatch):
    """The run's length as open_run / load_data give it (compiled.plan): 3 steps, hidden 256, one
    process on a CPU, no LoRA: eager, and the record says why and holds the verdict a resume takes."""
    monkeypatch.setattr(compiled, "_CHOICE", compiled._CHOICE)
    monkeypatch.setattr(compiled, "_STEPS", None)
    monkeypatch.setattr(compiled, "_RECORDED", None)
    monkeypatch.setitem(compiled._PROBLEM, "cpu", None)  # a working toolchain: not the reason
    compiled.configure("auto")
    compiled.plan(3)
    model = _model(hidden=256, layers=2)
    record = compiled.apply(model)
    assert record["blocks"] == 0 and compiled.compiled_blocks(model) == 0
    assert record["steps"] == 3 and record["pays"] is False
    assert record["why"].startswith("train.compile = auto: hidden size 256 ≥ 256: 3 steps")
    assert compiled.recorded_verdict({"actor": {"compile": record}, "x": {}}) is False
    # resumed: the recorded verdict stands whatever the length now
    compiled.configure("auto", recorded=False)
    compiled.plan(100000)
    assert compiled.apply(_model(hidden=256, layers=2))["blocks"] == 0


def test_a_process_compiles_nothing_until_a_run_configures_it(monkeypatch):
    monkeypatch.setattr(compiled, "_CHOICE", "eager")
    model = _model(hidden=256, layers=2)
    assert compiled.apply(model) == {"blocks": 0, "why": "train.compile = eager"}
    assert compiled.compiled_blocks(model) == 0
    with pytest.raises(ValueError, match="not one of auto, blocks, eager"):
        compiled.configure("yes")


def test_no_toolchain_means_eager_mode_and_says_why(monkeypatch):
    """Where torch.compile cannot run, the model stays eager (it still runs) and the record says why."""
    monkeypatch.setitem(compiled._PROBLEM, "cpu", "no C++ compiler for torch.compile ('g++' …)")
    model = _model()
    record = compiled.apply(model, "blocks")
    assert record["blocks"] == 0 and compiled.compiled_blocks(model) == 0
    assert record["why"] == (
        "train.compile = blocks; but no C++ compiler for torch.compile ('g++' …): eager mode, slower"
    )
    assert model._proximal_compile == record
    assert torch.isfinite(model(torch.tensor([[3, 4, 5]])).logits).all()
    line = compile_line({"actor": {"compile": record}, "critic": {"compile": record}})
    assert line == f"compile: actor, critic: eager ({record['why']})"


def test_compile_line_is_silent_for_models_auto_leaves_eager():
    small = {
        "blocks": 0,
        "why": "train.compile = auto: hidden size 32 < 256, too small (train.compile = blocks asks)",
    }
    assert compile_line({"actor": {"compile": small}, "reward_model": {}}) is None
    declined = {"blocks": 0, "why": "train.compile = blocks: several processes (not measured)"}
    assert (
        compile_line({"actor": {"compile": declined}})
        == f"compile: actor: eager ({declined['why']})"
    )
    big = {"blocks": 4, "why": "train.compile = auto: hidden size 256 ≥ 256"}
    assert compile_line({"actor": {"compile": big}, "critic": {"compile": small}}) == (
        f"compile: actor: 4 blocks compiled ({big['why']}); critic: eager ({small['why']})"
    )


def test_the_bfloat16_copy_of_a_compiled_model_runs_its_own_weights(monkeypatch):
    """A deep copy would keep the compiled blocks' functions, bound to the original's (float32) modules."""
    monkeypatch.setitem(compiled._PROBLEM, "cpu", None)
    model = _model()
    for block in compiled.blocks(model):
        block.compile()  # not run: the copy must not call it
    held = bfloat16_copy(model)
    assert compiled.compiled_blocks(held) == 0 and compiled.compiled_blocks(model) == 2
    with torch.no_grad():
        out = held(torch.tensor([[3, 4, 5]])).logits
    assert out.dtype == torch.bfloat16


def _forward_backward(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits.float().square() * mask[..., None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        frozen = model(input_ids=ids, attention_mask=mask).logits
    return logits.detach(), grads, frozen


@pytest.mark.slow
def test_compiled_blocks_match_eager_within_float32_round_off():
    """The fused loops sum in another order: the same logits and gradients up to round-off, with and
    without gradients, with a padded row, and at a second sequence length (a dynamic-shape graph)."""
    import torch._dynamo.utils  # lazy: the counters of what dynamo compiled

    eager = _model(hidden=64, layers=2)
    fused = copy.deepcopy(eager)
    assert compiled.apply(fused, "blocks")["blocks"] == 2
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(1)
    for T in (12, 17):
        ids = torch.randint(3, 97, (3, T), generator=g)
        mask = torch.ones(3, T, dtype=torch.long)
        mask[1, :4] = 0  # a left-padded row
        want = _forward_backward(eager, ids, mask)
        got = _forward_backward(fused, ids, mask)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
        assert got[1].keys() == want[1].keys()
        for name in want[1]:
            scale = want[1][name].abs().max().item()
            torch.testing.assert_close(
                got[1][name], want[1][name], rtol=1e-4, atol=1e-5 * scale, msg=name
            )
        # and not trivially: the gradients are far from zero
        assert max(v.abs().max().item() for v in want[1].values()) > 1.0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the blocks did compile


@pytest.mark.skipif(kernels._OP is None, reason="this torch has no oneDNN product")
def test_the_onednn_product_inside_a_compiled_function_is_eager_modes(monkeypatch):
    """Under compilation the oneDNN products are custom operators with the eager path's arithmetic:
    the same output and the same gradients (the products are the same calls)."""
    monkeypatch.setattr(kernels, "_BACKEND", ("onednn", "test"))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 33, 64, generator=g)
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g)

    def f(x, w, b):
        return (kernels.linear(x, w, b).square()).sum()

    def run(fn):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs)
        return (y.detach(), *torch.autograd.grad(y, (xs, ws, bs)))

    want = run(f)
    got = run(torch.compile(f, dynamic=False))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)
    assert want[0] > 1.0


@pytest.mark.slow
def test_a_compiled_models_lean_decode_samples_what_eager_mode_samples(monkeypatch):
    """With compiled blocks the lean decode step runs compiled too (one dynamic-shape graph): the same
    tokens, and log-probabilities within float32 round-off, over two rollouts of different lengths."""
    made = decode._compiled_step
    calls = []
    monkeypatch.setattr(decode, "_compiled_step", lambda: calls.append(1) or made())
    eager = _model(hidden=64, layers=2).eval()
    fused = copy.deepcopy(eager)
    assert compiled.apply(fused, "blocks")["blocks"] == 2
    engines = [HFEngine(m, 0) for m in (eager, fused)]
    g = torch.Generator().manual_seed(3)
    for B, P, T in ((3, 5, 9), (2, 7, 12)):
        ids = torch.randint(3, 97, (B, P), generator=g)
        mask = torch.ones(B, P, dtype=torch.long)
        mask[0, :2] = 0
        params = SamplingParams(max_new_tokens=T, stop_token_ids=(1,))
        with torch.no_grad():
            a, la = engines[0].generate(ids, mask, list(range(B)), params, logprobs=True)
            assert not calls  # the eager model's decoder steps in eager mode
            b, lb = engines[1].generate(ids, mask, list(range(B)), params, logprobs=True)
            assert len(calls) == T - 1 or bool((b == 1).any())  # every step compiled (or a stop)
            calls.clear()
        assert torch.equal(a, b)
        torch.testing.assert_close(lb, la, rtol=0, atol=2e-5)
    assert engines[1].decode_path()["path"] == "lean"


def test_cached_forwards_and_probes_run_the_blocks_eager_code():
    """A rollout's prompt pass and its decode steps outside the lean decoder carry a KV cache, and the
    fused log-probabilities' probe runs four tokens: none of them compiles a graph (each cached
    forward would compile every block on its own), and the tokens are eager mode's."""
    from torch._dynamo.utils import counters

    from proximal.models.output import fused_problem

    eager = _model(hidden=64, layers=2).eval()
    fused = copy.deepcopy(eager)
    assert compiled.apply(fused, "blocks")["blocks"] == 2
    # shapes no other test uses: no graph of them can be in dynamo's cache already
    ids = torch.randint(3, 97, (4, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, :2] = 0
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(1,))
    before = counters["frames"]["total"]
    with torch.no_grad():
        a = HFEngine(eager, 0, lean_decode=False).generate(ids, mask, [0, 1, 2, 3], params)
        b = HFEngine(fused, 0, lean_decode=False).generate(ids, mask, [0, 1, 2, 3], params)
    assert fused_problem(fused) is None
    assert counters["frames"]["total"] == before
    assert torch.equal(a, b)
