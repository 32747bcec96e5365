"""The lean decode step fails safe: a transformers release that renamed or changed what it uses gives
the model's own decode, the same tokens, and a reason naming what changed — never an error mid-rollout.

Each test plants one such change in a tiny Llama while the model's own forward keeps working (as it
would in the release that made the change): a function of the modeling module renamed away or
answering otherwise, a module attribute renamed consistently (the model's forward uses the new
name), ``DynamicCache`` layers without ``keys``, a lean step that raises. The expected tokens are
those of ``lean_decode=False`` on the unchanged model, and the lean step's calls are counted, so a
fallback that silently kept the lean path (or crashed) fails.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import transformers
from lean_support import prompts, tiny_lm
from transformers.cache_utils import DynamicLayer
from transformers.models.llama import modeling_llama

from proximal.rollout import decode
from proximal.rollout.engine import HFEngine, SamplingParams

PARAMS = SamplingParams(max_new_tokens=10, stop_token_ids=(1,), temperature=0.9)
SEEDS = list(range(6))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("lm")


def _own_tokens(model) -> torch.Tensor:
    ids, mask = prompts()
    return HFEngine(model, 0, lean_decode=False).generate(ids, mask, SEEDS, PARAMS)


def _fell_back(model, reason_has: str, lean_steps) -> HFEngine:
    """The engine declines at start-up with a reason containing ``reason_has`` and samples the
    model's own tokens without a lean step."""
    engine = HFEngine(model, 0)
    reason = engine.lean_reason()
    assert reason is not None and reason_has in reason, reason
    assert engine.decode_path() == {"path": "generate", "reason": reason}
    assert (
        engine.describe_decode()
        == f"the model's own forward at every token (lean decode: {reason})"
    )
    ids, mask = prompts()
    got = engine.generate(ids, mask, SEEDS, PARAMS)
    assert lean_steps[0] == 0
    return got


def _without(module: types.ModuleType, name: str, **replace) -> types.ModuleType:
    """A copy of ``module`` without ``name`` (or with ``replace``'s values), as a release that renamed
    or changed it would look to the lean step; the model's own code keeps its own globals."""
    fake = types.ModuleType(module.__name__)
    fake.__dict__.update({k: v for k, v in vars(module).items() if k != name})
    fake.__dict__.update(replace)
    return fake


def test_an_unchanged_model_decodes_the_lean_way(saved, lean_steps):
    """The control: the same model, nothing changed, is taken, and its lean tokens are its own."""
    model = tiny_lm("llama", saved)
    engine = HFEngine(model, 0)
    assert engine.lean_reason() is None and engine.decode_path() == {"path": "lean", "reason": None}
    ids, mask = prompts()
    assert torch.equal(engine.generate(ids, mask, SEEDS, PARAMS), _own_tokens(model))
    assert lean_steps[0] > 0


@pytest.mark.parametrize(
    "name", ["apply_rotary_pos_emb", "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"]
)
def test_a_function_missing_from_the_modeling_module(name, saved, monkeypatch, lean_steps):
    model = tiny_lm("llama", saved)
    want = _own_tokens(model)
    monkeypatch.setitem(sys.modules, modeling_llama.__name__, _without(modeling_llama, name))
    got = _fell_back(model, f"{modeling_llama.__name__} has no {name}", lean_steps)
    assert torch.equal(got, want)


def test_a_rotary_function_with_another_signature(saved, monkeypatch, lean_steps):
    """A release whose apply_rotary_pos_emb takes another argument: the probe's call fails, not a rollout."""

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)

    model = tiny_lm("llama", saved)
    want = _own_tokens(model)
    fake = _without(modeling_llama, "", apply_rotary_pos_emb=apply_rotary_pos_emb)
    monkeypatch.setitem(sys.modules, modeling_llama.__name__, fake)
    got = _fell_back(model, "rotary embedding", lean_steps)
    assert "TypeError" in HFEngine(model, 0).lean_reason()
    assert torch.equal(got, want)


def test_an_eager_attention_with_another_mask_convention(saved, monkeypatch, lean_steps):
    """A release whose eager attention takes a boolean mask (True = attend) instead of the additive
    0 / finfo.min one: called with the additive mask it attends to the wrong positions without any
    error, which only the probe's comparison with the attention computed by hand sees."""

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        n = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)
        scores = (query @ key.transpose(2, 3)) * scaling
        scores = scores.masked_fill(~attention_mask.bool(), -torch.inf)
        return (scores.softmax(-1) @ value).transpose(1, 2), None

    class Registry:
        def get_interface(self, impl, default):
            return eager

    model = tiny_lm("llama", saved, attn="eager")
    want = _own_tokens(model)
    fake = _without(modeling_llama, "", ALL_ATTENTION_FUNCTIONS=Registry())
    monkeypatch.setitem(sys.modules, modeling_llama.__name__, fake)
    got = _fell_back(model, "'eager' attention function does not attend as expected", lean_steps)
    assert torch.equal(got, want)


def _rename(monkeypatch, module: torch.nn.Module, old: str, new: str) -> None:
    """Rename ``module``'s child ``old`` to ``new`` as a release would: for the model's own forward
    (patched on the class) the child has its old name again, for everyone else only the new one."""
    forward = type(module).forward

    def renamed_forward(self, *args, **kwargs):
        if new not in self._modules:  # another instance of the class: untouched
            return forward(self, *args, **kwargs)
        self._modules[old] = self._modules.pop(new)
        try:
            return forward(self, *args, **kwargs)
        finally:
            self._modules[new] = self._modules.pop(old)

    module._modules[new] = module._modules.pop(old)
    monkeypatch.setattr(type(module), "forward", renamed_forward)


@pytest.mark.parametrize(
    "part,old,expected",
    [
        ("self_attn", "q_proj", "layer 1's self_attn has no q_proj"),
        ("self_attn", "o_proj", "layer 1's self_attn has no o_proj"),
        ("mlp", "down_proj", "layer 1's mlp has no down_proj"),
        (None, "post_attention_layernorm", "layer 1 has no post_attention_layernorm"),
    ],
)
def test_a_renamed_module_attribute(part, old, expected, saved, monkeypatch, lean_steps):
    """Renamed in the last layer only, so a check of the first layer alone would miss it."""
    model = tiny_lm("llama", saved)
    want = _own_tokens(model)
    layer = model.model.layers[-1]
    _rename(monkeypatch, getattr(layer, part) if part else layer, old, old + "_renamed")
    got = _fell_back(model, expected, lean_steps)
    assert torch.equal(got, want)


class RenamedLayer(DynamicLayer):
    """A ``DynamicLayer`` as a release that renamed ``keys``/``values`` to ``k``/``v`` would have it:
    working for the model's own forward, without ``keys`` for anyone else."""

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.k, self.v = key_states[..., :0, :], value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.k = torch.cat([self.k, key_states], dim=-2)
        self.v = torch.cat([self.v, value_states], dim=-2)
        return self.k, self.v

    def get_seq_length(self):
        return self.k.shape[-2] if self.is_initialized else 0


class RenamedCache(transformers.DynamicCache):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layers = [RenamedLayer() for _ in self.layers]


def test_cache_layers_without_keys_are_seen_at_start_up(saved, monkeypatch, lean_steps):
    model = tiny_lm("llama", saved)
    want = _own_tokens(model)
    monkeypatch.setattr(modeling_llama, "DynamicCache", RenamedCache)  # what the model builds
    got = _fell_back(model, "a DynamicCache's layer 0 (RenamedLayer) has no keys", lean_steps)
    assert torch.equal(got, want)


def test_a_cache_of_another_form_at_a_rollout_is_declined_there(
    saved, monkeypatch, lean_steps, capsys
):
    """The model builds a cache the start-up check did not see (its class changed after the engine
    was built): the rollout checks the cache it got before any decode step, goes the model's own
    way and says so once."""
    model = tiny_lm("llama", saved)
    want = _own_tokens(model)
    engine = HFEngine(model, 0)
    assert engine.lean_reason() is None  # nothing wrong that start-up could see
    monkeypatch.setattr(modeling_llama, "DynamicCache", RenamedCache)
    ids, mask = prompts()
    capsys.readouterr()
    for _ in range(2):
        assert torch.equal(engine.generate(ids, mask, SEEDS, PARAMS), want)
    assert lean_steps[0] == 0
    said = capsys.readouterr().out.splitlines()
    assert said == [
        "proximal: decode: the model's own forward (lean decode: the prompt's cache's layer 0 "
        "(RenamedLayer) has no keys and values)"
    ]


@pytest.mark.parametrize("fail_at", ["start", "step"])
def test_a_lean_step_that_raises_mid_rollout(fail_at, saved, monkeypatch, lean_steps, capsys):
    """What no check foresaw: the decoder's construction, or its third step, raises. The rollout
    goes on with the model's own forward from the prompt and the tokens so far (the same tokens),
    says why once, and later rollouts do not try the lean step again."""
    model = tiny_lm("llama", saved)
    want = _own_tokens(model)
    if fail_at == "start":

        def broken_init(self, *args, **kwargs):
            raise AttributeError("'LlamaAttention' object has no attribute 'rotary_fn'")

        monkeypatch.setattr(decode.LeanDecoder, "__init__", broken_init)
    else:
        step = decode.LeanDecoder.step  # lean_steps' counting step

        def third_fails(self, *args):
            if lean_steps[0] == 2:
                raise RuntimeError("shape mismatch")
            return step(self, *args)

        monkeypatch.setattr(decode.LeanDecoder, "step", third_fails)
    engine = HFEngine(model, 0)
    assert engine.lean_reason() is None
    ids, mask = prompts()
    capsys.readouterr()
    assert torch.equal(engine.generate(ids, mask, SEEDS, PARAMS), want)
    reason = engine.lean_reason()
    expected = (
        "starting it failed (AttributeError: 'LlamaAttention' object has no attribute 'rotary_fn')"
        if fail_at == "start"
        else "its step failed at token 4 (RuntimeError: shape mismatch)"
    )
    assert reason == expected
    assert engine.decode_path() == {"path": "generate", "reason": reason}
    assert (
        capsys.readouterr().out
        == f"proximal: decode: the model's own forward (lean decode: {reason})\n"
    )
    before = lean_steps[0]
    assert torch.equal(engine.generate(ids, mask, SEEDS, PARAMS), want)
    assert lean_steps[0] == before and capsys.readouterr().out == ""


def test_the_start_up_checks_run_once_per_engine_not_per_rollout(saved, monkeypatch):
    model = tiny_lm("llama", saved)
    calls = [0]
    probe = decode._probe

    def counted(*args):
        calls[0] += 1
        return probe(*args)

    monkeypatch.setattr(decode, "_probe", counted)
    engine = HFEngine(model, 0)
    ids, mask = prompts()
    for _ in range(3):
        engine.generate(ids, mask, SEEDS, PARAMS)
    assert calls[0] == 1


def test_a_reason_is_said_once_even_when_its_numbers_change(saved, capsys):
    """A cache of another shape at each prompt length is one reason, not a line per rollout."""
    engine = HFEngine(tiny_lm("llama", saved), 0)
    capsys.readouterr()
    for P in (7, 9, 7):
        engine._say(
            f"the prompt's cache holds keys of shape (6, 2, {P - 1}, 16), not (6, heads, {P}, head_dim)"
        )
    engine._say("a sliding attention window (4 positions) narrower than prompt and response")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "(6, 2, 6, 16)" in lines[0] and "sliding" in lines[1]
