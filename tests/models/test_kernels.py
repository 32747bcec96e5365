"""proximal.models.kernels: float32 CPU linears through oneDNN, checked against float64 products.

The expected values are float64 matrix products of the same inputs (not the library's own float32
path), and the tolerance is float32's: a wrong transpose, a dropped bias or a gradient of the wrong
orientation is off by O(1). Each test also counts the oneDNN calls, so a silent fall-back to
``F.linear`` cannot pass for the fast path. The backend's choice (``train.cpu_matmul``, the
environment's override, the CPU's default) and its fall-backs where torch lacks or changed an
operator are checked at the end.
"""

from __future__ import annotations

import contextlib
import json
import types
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from proximal.config import ConfigError
from proximal.models import kernels
from proximal.rollout import engine

pytestmark = pytest.mark.skipif(kernels._OP is None, reason="this torch has no oneDNN linear")


@pytest.fixture
def configure(monkeypatch, tmp_path):
    """``configure(choice)``: :func:`kernels.configure` for one test (``PROXIMAL_CPU_MATMUL`` unset,
    "auto"'s cache in ``tmp_path``); the process's backend and operators come back afterwards."""
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setattr(kernels, "cache_path", lambda: tmp_path / "cpu_matmul.json")
    for name in ("_BACKEND", "_OP", "_REORDER", "_PROBED"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    return kernels.configure


@pytest.fixture
def calls(monkeypatch, configure):
    """The number of oneDNN products run, by wrapping the operator the module calls; the backend
    is oneDNN, on whatever CPU runs the tests."""
    assert configure("onednn") == ("onednn", "train.cpu_matmul = onednn")
    n = [0]
    op = kernels._OP

    def counted(*args):
        n[0] += 1
        return op(*args)

    monkeypatch.setattr(kernels, "_OP", counted)
    return n


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-6):
    """float32 results against float64 ones: error within ``rel`` of the largest magnitude."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), (err, want.abs().max().item())


# (leading shape, K, N): the first has M·N ≤ (M + N)·K (∂W copies ∂yᵀ), the second the opposite
# (∂W = (xᵀ·∂y)ᵀ), the third a 3-d input of 16 × 64 tokens like a transformer block's.
SHAPES = [((512,), 1024, 256), ((1024,), 256, 1024), ((16, 64), 256, 768)]


@pytest.mark.parametrize("lead,K,N", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_match_float64(calls, lead, K, N, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, K, generator=g, requires_grad=True)
    w = torch.randn(N, K, generator=g, requires_grad=True)
    b = torch.randn(N, generator=g, requires_grad=True) if bias else None
    gy = torch.randn(*lead, N, generator=g)

    y = kernels.linear(x, w, b)
    y.backward(gy)
    assert calls[0] == 3  # the forward product and both products of backward

    x64, w64, gy64 = x.detach().double(), w.detach().double(), gy.double()
    want = x64 @ w64.T + (b.detach().double() if bias else 0)
    _close(y.detach(), want)
    _close(x.grad, gy64 @ w64)
    _close(w.grad, gy64.reshape(-1, N).T @ x64.reshape(-1, K))
    if bias:
        _close(b.grad, gy64.reshape(-1, N).sum(0))


def test_only_the_gradients_asked_for(calls):
    """A frozen weight (the reference, the reward model) gets no ∂W product; a leaf input none for ∂x."""
    x = torch.randn(512, 512, requires_grad=True)
    w = torch.randn(512, 512)
    kernels.linear(x, w).sum().backward()
    assert calls[0] == 2 and x.grad is not None
    calls[0] = 0
    x = torch.randn(512, 512)
    w = torch.randn(512, 512, requires_grad=True)
    kernels.linear(x, w).sum().backward()
    assert calls[0] == 2 and w.grad is not None


def test_no_grad_and_non_contiguous_input(calls):
    base = torch.randn(1024, 512)
    x = base.t()  # (512, 1024), a transposed view
    w = torch.randn(256, 1024)
    with torch.no_grad():
        y = kernels.linear(x, w)
    assert calls[0] == 1 and y.grad_fn is None
    _close(y, x.double() @ w.double().T)


def test_falls_back_where_onednn_does_not_pay_or_apply(calls):
    small = torch.randn(4, 64), torch.randn(64, 64)  # 16k multiply-adds
    assert torch.equal(kernels.linear(*small), torch.nn.functional.linear(*small))
    big = torch.randn(512, 512), torch.randn(512, 512)
    kernels.linear(big[0].double(), big[1].double())  # float64
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast must see F.linear to cast it
        assert kernels.linear(*big).dtype == torch.bfloat16
    kernels.configure("blas")
    kernels.linear(*big)
    assert calls[0] == 0


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def test_a_patched_model_trains_like_the_plain_one(calls):
    """Loss and every parameter's gradient of a Llama with its linears routed through oneDNN agree with
    the same model computed in float64 (the float32 BLAS model is checked against the same reference,
    so the tolerance is float32's own); the state dict is unchanged."""
    fast, ref = _llama(), _llama()
    keys = list(fast.state_dict())
    assert kernels.use_onednn_linears(fast) == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    assert kernels.use_onednn_linears(fast) == 15  # idempotent
    assert list(fast.state_dict()) == keys
    ref.double()
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    loss = fast(input_ids=ids, labels=ids).loss
    loss.backward()
    assert calls[0] == 3 * 15
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-6 * want.item()
    # On AMD's AVX-512 CPUs oneDNN's products are as exact as BLAS: measured 1.4e-6 of the largest
    # gradient (BLAS 1.1e-6). On an Intel Xeon with AMX the same oneDNN kernel gave 1.6e-4 in about
    # one process in three (1.4e-6 in the others): there it is held to 1e-3.
    tol = 1e-3 if "GenuineIntel" in _cpuinfo() else 1e-5
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        scale = q.grad.abs().max().item()
        assert (p.grad.double() - q.grad).abs().max().item() <= tol * scale, name


def test_lora_base_layers_are_routed(calls):
    """LoRA on q_proj: the frozen base linears go through oneDNN (only ∂x is asked of them), the rank-8
    factors stay with F.linear; the adapters' gradients equal those of the same model unrouted."""
    from peft import LoraConfig, get_peft_model

    def lora_model():
        return get_peft_model(
            _llama(),
            LoraConfig(
                r=8,
                lora_alpha=16,
                lora_dropout=0.0,
                target_modules=["q_proj"],
                init_lora_weights=False,
            ),
        )  # B ≠ 0: gradients reach A

    model, plain = lora_model(), lora_model()
    assert (
        kernels.use_onednn_linears(model) == 15 + 2 * 2
    )  # the base linears, and each adapter's A and B
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(4))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls[0] > 15  # every base linear's forward, and backward products
    plain(input_ids=ids, labels=ids).loss.backward()
    trained = [
        (n, p, q)
        for (n, p), q in zip(model.named_parameters(), plain.parameters())
        if p.requires_grad
    ]
    assert len(trained) == 4
    for name, p, q in trained:
        assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), name


def test_packed_weights_for_passes_without_gradients(calls):
    """Inside ``packed_weights`` a no-grad forward multiplies by the weight reordered at its first call
    (the same products, float64-checked); a forward with gradients still trains the live weight; on
    leaving, the copies are gone."""
    model = _llama()
    kernels.use_onednn_linears(model)
    ids = torch.randint(0, 512, (16, 8), generator=torch.Generator().manual_seed(2))
    ref = _llama().double()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    with kernels.packed_weights(model, rows=16) as n:
        assert n == 15
        assert not any(
            "_proximal_packed" in m.__dict__ for m in model.modules()
        )  # nothing reordered yet
        with torch.no_grad():
            got = model(input_ids=ids).logits
        assert all(
            "_proximal_packed" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear
        )
        _close(got, want, rel=1e-5)
        packed = model.lm_head._proximal_packed
        with torch.no_grad():
            model(input_ids=ids)
        assert model.lm_head._proximal_packed is packed  # reordered once, not at every call
        loss = model(input_ids=ids, labels=ids).loss  # with gradients: the plain weights
        loss.backward()
        assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    assert not any("_proximal_packed" in m.__dict__ for m in model.modules())
    kernels.configure("blas")
    with kernels.packed_weights(model, rows=16) as n:
        assert n == 0


def test_fused_packed_is_the_stacked_products(calls):
    """One product for several linears of the same input: its columns are each linear's output
    (float64-checked, biases included), in one oneDNN call; only inside ``packed_weights``, and
    not for linears of different inputs or with and without bias."""
    g = torch.Generator().manual_seed(5)
    mods = [torch.nn.Linear(64, n, bias=True) for n in (96, 32, 32)]
    kernels.use_onednn_linears(torch.nn.Sequential(*mods))
    x = torch.randn(16, 64, generator=g)
    assert kernels.fused_packed(mods) is None  # not inside packed_weights
    with kernels.packed_weights(torch.nn.Sequential(*mods), rows=16):
        w, b = kernels.fused_packed(mods)
        before = calls[0]
        y = kernels.packed_linear(x, w, b)
        assert calls[0] == before + 1
        assert kernels.fused_packed([mods[0], torch.nn.Linear(32, 8)]) is None
        nobias = torch.nn.Linear(64, 8, bias=False)
        with kernels.packed_weights(nobias, rows=16):
            assert kernels.fused_packed([mods[0], nobias]) is None
    want = torch.cat([x.double() @ m.weight.double().t() + m.bias.double() for m in mods], 1)
    _close(y, want)


@pytest.mark.parametrize("bf16_mixed", [False, True])
def test_generation_with_packed_weights_samples_the_same_tokens(bf16_mixed, calls, monkeypatch):
    """Float32 copies, or bfloat16 ones under bf16-mixed's autocast: the same tokens as unpacked."""
    model = _llama()
    kernels.use_onednn_linears(model)
    if bf16_mixed:
        model._proximal_autocast = torch.bfloat16  # what prepare_trained sets for bf16-mixed
    ids = torch.randint(4, 512, (16, 12), generator=torch.Generator().manual_seed(3))
    params = engine.SamplingParams(max_new_tokens=24, stop_token_ids=(1,))
    packed = engine.HFEngine(model, 0).generate(ids, torch.ones_like(ids), list(range(16)), params)
    monkeypatch.setattr(engine, "packed_weights", lambda model, rows: contextlib.nullcontext())
    plain = engine.HFEngine(model, 0).generate(ids, torch.ones_like(ids), list(range(16)), params)
    assert packed.shape == (16, 24) and torch.equal(packed, plain)


def test_under_autocast_the_packed_copies_are_bfloat16(calls):
    """bf16-mixed decodes under bfloat16 autocast: the copies are bfloat16 (half the bytes), and a
    packed product — one linear's or a stacked one's — is bit for bit what autocast's own F.linear
    gives (it casts the input, weight and bias to bfloat16 and multiplies those), in one oneDNN call.
    A float32 call after autocast is left is not served by a bfloat16 copy. (On a CPU without
    oneDNN's bfloat16 products nothing is packed: the next two tests.)"""
    why = kernels.packs_bfloat16()
    if why is not None:
        pytest.skip(f"this CPU: {why}")
    model = _llama()
    kernels.use_onednn_linears(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(16, 1, 256, generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = [
            torch.nn.functional.linear(x, p.weight, p.bias)
            for p in (attn.q_proj, attn.k_proj, attn.v_proj)
        ]
        with kernels.packed_weights(model, rows=16) as n:
            assert n == sum(type(m) is torch.nn.Linear for m in model.modules())
            before = calls[0]
            got = attn.q_proj(x)
            assert (
                calls[0] == before + 1 and attn.q_proj._proximal_packed[0].dtype == torch.bfloat16
            )
            assert got.dtype == torch.bfloat16 and torch.equal(got, want[0])
            w, b = kernels.fused_packed([attn.q_proj, attn.k_proj, attn.v_proj])
            assert w.dtype == torch.bfloat16 and b is None
            assert torch.equal(kernels.packed_linear(x, w, b), torch.cat(want, dim=-1))
            with torch.autocast("cpu", enabled=False):
                plain = attn.q_proj(x)
            assert plain.dtype == torch.float32
            _close(plain[:, 0], x[:, 0].double() @ attn.q_proj.weight.double().t())


def test_without_bfloat16_products_autocast_packs_nothing(calls, monkeypatch):
    """Where oneDNN has no bfloat16 product (an AVX2-only CPU: its reorder raises), bf16-mixed decoding
    packs no weight and every product is autocast's own F.linear, bit for bit; float32 decoding
    still packs."""
    monkeypatch.setattr(kernels, "packs_bfloat16", lambda: "oneDNN's bfloat16 product failed")
    model = _llama()
    kernels.use_onednn_linears(model)
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(16, 1, 256, generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.linear(x, q.weight, q.bias)
        with kernels.packed_weights(model, rows=16) as n:
            got = q(x)
            assert n == 0 and "_proximal_packed" not in q.__dict__
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with torch.no_grad(), kernels.packed_weights(model, rows=16) as n:
        assert n == sum(type(m) is torch.nn.Linear for m in model.modules())


def test_packs_bfloat16_says_why_when_oneDNN_refuses(monkeypatch):
    """The probe behind it: a reorder that raises (as oneDNN's does for bfloat16 without AVX-512 or
    AVX-NE-CONVERT) is a reason naming the error; a reorder that works is None."""

    def refuse(w, rows):
        if w.dtype == torch.bfloat16:
            raise RuntimeError("bf16 path needs the cpu support avx_ne_convert")
        return w

    monkeypatch.setattr(kernels, "_OP", lambda x, w, b, *a: torch.nn.functional.linear(x, w, b))
    monkeypatch.setattr(kernels, "_REORDER", refuse)
    monkeypatch.setattr(kernels, "_BF16_PACKING", [])
    why = kernels.packs_bfloat16()
    assert why is not None and "avx_ne_convert" in why and "RuntimeError" in why
    assert kernels._BF16_PACKING == [why]  # asked once a process
    monkeypatch.setattr(kernels, "_REORDER", lambda w, rows: w)
    assert kernels._bfloat16_problem() is None
    monkeypatch.setattr(kernels, "_REORDER", None)  # not an answer to keep: nothing was tried
    assert kernels.packs_bfloat16() == "no oneDNN product or reorder operator"
    assert kernels._BF16_PACKING == [why]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _rounds(blas: list[float], onednn: list[float]):
    """A probe that reports these round times (seconds) instead of timing anything."""
    return lambda: {"blas": list(blas), "onednn": list(onednn)}


@pytest.mark.parametrize(
    "blas,onednn,want,noise",
    [
        # oneDNN twice as fast, the rounds steady (medians 2.01 and 1.005: 0.5 % over the fastest)
        ([2.0, 2.02, 2.02, 2.0], [1.0, 1.01, 1.0, 1.01], "onednn", 0.005),
        # BLAS faster: BLAS
        ([1.0, 1.0, 1.0, 1.0], [1.5, 1.5, 1.5, 1.5], "blas", 0.0),
        # oneDNN 4 % faster, inside the 5 % floor of the margin: BLAS, the public path
        ([1.04, 1.04, 1.04, 1.04], [1.0, 1.0, 1.0, 1.0], "blas", 0.0),
        # oneDNN 1.5x faster, but BLAS's median round twice its fastest (a busy machine): 1.0 · 2
        # is not below 1.5, within the noise, BLAS
        ([1.5, 3.0, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0], "blas", 1.0),
        # oneDNN 1.5x faster, medians 10 % over the fastest (1.65, 1.1): 1.0 · 1.1 < 1.5, oneDNN
        ([1.5, 1.8, 1.8, 1.5], [1.0, 1.2, 1.2, 1.0], "onednn", 0.1),
    ],
)
def test_auto_decides_by_the_measured_rates(blas, onednn, want, noise):
    """The fastest round of each backend counts; oneDNN only where it beats BLAS by more than the
    noise (the larger median/fastest − 1 of the two, at least PROBE_MIN_MARGIN)."""
    backend, rec = kernels.decide({"blas": blas, "onednn": onednn})
    assert backend == rec["backend"] == want
    assert rec["noise"] == pytest.approx(noise, abs=1e-12)
    flops = 2 * 512 * (256 * 256 + 256 * 1024 + 1024 * 256)  # one round of PROBE_SHAPES, by hand
    assert kernels.probe_flops() == flops
    assert rec["rates"]["blas"] == pytest.approx(flops / min(blas), rel=1e-12)
    assert rec["rates"]["onednn"] == pytest.approx(flops / min(onednn), rel=1e-12)


def test_the_probe_times_both_backends_in_alternation(monkeypatch):
    """probe_seconds: a warm-up round of each, then alternating rounds, each round every shape once
    through F.linear (blas) or the oneDNN operator, the products right (no timing asserted)."""
    seen = []
    op = kernels._OP

    def onednn(x, w, *rest):
        seen.append(("onednn", x.shape[0], w.shape))
        return op(x, w, *rest)

    real = torch.nn.functional.linear
    monkeypatch.setattr(kernels, "_OP", onednn)
    monkeypatch.setattr(
        torch.nn.functional,
        "linear",
        lambda x, w, *r: seen.append(("blas", x.shape[0], w.shape)) or real(x, w, *r),
    )
    times = kernels.probe_seconds(rounds=2)
    assert {b: len(t) for b, t in times.items()} == {"blas": 2, "onednn": 2}
    assert all(t > 0 for ts in times.values() for t in ts)
    shapes = [(m, torch.Size([n, k])) for m, k, n in kernels.PROBE_SHAPES]
    one = [("blas", *s) for s in shapes] + [("onednn", *s) for s in shapes]
    assert seen == one * 3  # the warm-up round and two timed ones


def test_the_measurement_is_cached_per_machine(tmp_path, monkeypatch):
    """The first "auto" measures and writes the cache; the next reads it (no probe); another machine
    key measures again and keeps the first entry; a noisy measurement, or an unreadable cache, is
    not trusted; an unwritable cache leaves the choice standing."""
    path = tmp_path / "proximal" / "cpu_matmul.json"
    monkeypatch.setattr(kernels, "machine_key", lambda: "CPU A | torch x | 2 threads")
    monkeypatch.setattr(kernels, "busy_load", lambda: None)
    fast = _rounds([2.0] * 4, [1.0] * 4)
    backend, rec = kernels.auto_backend(fast, path)
    assert (backend, rec["cached"], rec["key"]) == ("onednn", False, "CPU A | torch x | 2 threads")
    stored = json.loads(path.read_text())
    assert list(stored) == ["CPU A | torch x | 2 threads"]
    assert stored["CPU A | torch x | 2 threads"]["backend"] == "onednn"

    def no_probe():
        raise AssertionError("probed although cached")

    backend, again = kernels.auto_backend(no_probe, path)
    assert backend == "onednn" and again["cached"] and again["rates"] == rec["rates"]

    monkeypatch.setattr(kernels, "machine_key", lambda: "CPU A | torch x | 4 threads")
    assert kernels.auto_backend(_rounds([1.0] * 4, [2.0] * 4), path)[0] == "blas"
    assert sorted(json.loads(path.read_text())) == [
        "CPU A | torch x | 2 threads",
        "CPU A | torch x | 4 threads",
    ]

    monkeypatch.setattr(kernels, "machine_key", lambda: "CPU B | torch x | 2 threads")
    # oneDNN 4x faster at its best, but BLAS's median round twice its fastest: too noisy to trust,
    # so torch's BLAS by rule, not cached (measured again next)
    noisy = _rounds([2.0, 4.0, 4.0, 4.0], [0.5] * 4)
    backend, rec = kernels.auto_backend(noisy, path)
    assert backend == "blas" and rec["backend"] == "blas" and rec["rule"] == "noisy"
    assert rec["noise"] == 1.0 and not rec["cached"]
    assert "CPU B | torch x | 2 threads" not in json.loads(path.read_text())  # measured again next
    assert kernels.describe(rec).startswith("torch's BLAS by rule: the probe was too noisy")

    def no_timing():
        raise AssertionError("timed on a busy machine")

    monkeypatch.setattr(kernels, "busy_load", lambda: 2.4)  # others keep the cores busy
    backend, rec = kernels.auto_backend(no_timing, path)  # nothing cached: BLAS by rule, untimed
    assert backend == "blas" and rec["rule"] == "busy" and rec["busy_load"] == 2.4
    assert not rec["cached"] and "rates" not in rec
    assert "CPU B | torch x | 2 threads" not in json.loads(path.read_text())
    assert kernels.describe(rec) == (
        "torch's BLAS by rule: the machine is busy (load 2.4 beyond the free cores), so a timing "
        "would be noise; nothing measured or cached"
    )
    monkeypatch.setattr(kernels, "machine_key", lambda: "CPU A | torch x | 2 threads")
    assert kernels.auto_backend(no_timing, path)[0] == "onednn"  # a cached measurement stands
    monkeypatch.setattr(kernels, "machine_key", lambda: "CPU B | torch x | 2 threads")
    monkeypatch.setattr(kernels, "busy_load", lambda: None)

    path.write_text("{not json")
    assert kernels.auto_backend(fast, path)[1]["cached"] is False
    assert list(json.loads(path.read_text())) == ["CPU B | torch x | 2 threads"]

    blocked = tmp_path / "file"
    blocked.write_text("")
    assert kernels.auto_backend(fast, blocked / "cpu_matmul.json")[0] == "onednn"


def test_a_busy_machine_is_the_load_beyond_the_free_cores(monkeypatch):
    """With 4 cores and 2 threads 2 are free: a load average above 2.5 is busy, at or below it not."""
    monkeypatch.setattr(kernels.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(kernels.os, "getloadavg", lambda: (2.6, 0.0, 0.0))
    assert kernels.busy_load() == 2.6
    monkeypatch.setattr(kernels.os, "getloadavg", lambda: (2.5, 9.0, 9.0))
    assert kernels.busy_load() is None


def test_the_cache_key_is_the_cpu_torch_and_threads(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_name", lambda: "Some CPU")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert kernels.machine_key() == f"Some CPU | torch {torch.__version__} | 3 threads"
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert kernels.cache_path() == Path("/x/cache/proximal/cpu_matmul.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kernels.cache_path() == Path.home() / ".cache" / "proximal" / "cpu_matmul.json"


@pytest.mark.parametrize("faster", ["onednn", "blas"])
def test_the_choice_and_the_environment_override(faster, configure, monkeypatch):
    """train.cpu_matmul picks the backend; "auto" is the measured one, and says its rates;
    PROXIMAL_CPU_MATMUL overrides the choice and says so; a product then goes through oneDNN or
    not accordingly."""
    rounds = ([2.0] * 4, [1.0] * 4) if faster == "onednn" else ([1.0] * 4, [2.0] * 4)
    record = kernels.decide({"blas": rounds[0], "onednn": rounds[1]})[1]
    monkeypatch.setattr(
        kernels, "auto_backend", lambda: (faster, {**record, "threads": 2, "cached": False})
    )
    fast, slow = (1, 0.5) if faster == "onednn" else (0.5, 1)
    flops = kernels.probe_flops() / 1e9
    reason = (
        f"train.cpu_matmul = auto: measured, oneDNN {flops * fast:.0f}, BLAS {flops * slow:.0f} "
        "GFLOP/s on 2 threads (noise 0 %)"
    )
    assert configure("auto") == (faster, reason)
    assert kernels.backend() == (faster, reason)
    assert kernels.probed()["rates"] == record["rates"]
    assert kernels.enabled() is (faster == "onednn")
    assert configure("onednn") == ("onednn", "train.cpu_matmul = onednn")
    assert kernels.probed() is None  # given, not measured
    assert configure("blas") == ("blas", "train.cpu_matmul = blas") and not kernels.enabled()
    monkeypatch.setenv(kernels.ENV, "onednn")
    assert configure("blas") == (
        "onednn",
        "PROXIMAL_CPU_MATMUL=onednn overrides train.cpu_matmul = blas",
    )
    assert kernels.enabled()
    monkeypatch.setenv(kernels.ENV, "blas")
    assert configure("auto") == (
        "blas",
        "PROXIMAL_CPU_MATMUL=blas overrides train.cpu_matmul = auto",
    )
    assert kernels.probed() is None  # the override measures nothing
    monkeypatch.setenv(kernels.ENV, "BLAS ")  # as a shell may leave it
    assert configure("blas") == ("blas", "train.cpu_matmul = blas")
    x, w = torch.randn(512, 512), torch.randn(512, 512)
    ran = []  # the backends under which the oneDNN operator computed the product
    for choice in ("onednn", "blas"):
        monkeypatch.setenv(kernels.ENV, choice)
        configure("auto")
        op = kernels._OP
        monkeypatch.setattr(kernels, "_OP", lambda *a, op=op, c=choice: ran.append(c) or op(*a))
        kernels.linear(x, w)
    assert ran == ["onednn"]


def test_a_rank_adopts_rank_0s_choice(configure):
    configure("blas")
    assert kernels.adopt("onednn", "rank 0's reason") == ("onednn", "rank 0's reason")
    assert kernels.enabled()


def test_a_wrong_value_names_the_field_or_the_variable(configure, monkeypatch):
    with pytest.raises(
        ConfigError, match=r"train.cpu_matmul = 'mkl' is not one of auto, onednn, blas"
    ):
        configure("mkl")
    monkeypatch.setenv(kernels.ENV, "on")
    with pytest.raises(
        ConfigError, match=r"PROXIMAL_CPU_MATMUL='on' is not one of auto, onednn, blas"
    ):
        configure("auto")


def test_nothing_configured_is_auto(configure, monkeypatch):
    """A library user who never configures gets "auto" at the first product (measured then)."""
    monkeypatch.setattr(kernels, "_BACKEND", None)
    rec = kernels.decide({"blas": [2.0] * 4, "onednn": [1.0] * 4})[1]
    monkeypatch.setattr(kernels, "auto_backend", lambda: ("onednn", {**rec, "cached": True}))
    assert kernels.enabled()
    assert kernels.backend()[1].startswith("train.cpu_matmul = auto: cached measurement, oneDNN")


class _Without:
    """``torch.ops.mkldnn`` as a torch release that renamed (or broke) some of its operators has it."""

    def __init__(self, ops, missing=(), broken=()):
        self.ops, self.missing, self.broken = ops, missing, broken

    def __getattr__(self, name):
        if name in self.missing:
            raise AttributeError(f"'_OpNamespace' 'mkldnn' object has no attribute '{name}'")
        if name in self.broken:  # answers, but wrongly
            return types.SimpleNamespace(default=lambda *a: torch.zeros(3, 5))
        return getattr(self.ops, name)


def test_without_the_reorder_operator_weights_are_not_packed(configure, monkeypatch):
    """A torch without ``_reorder_linear_weight``: configure says so; oneDNN still computes the
    products, but ``packed_weights`` packs nothing and the lean step stacks nothing; generation
    samples the same tokens as with packed weights."""
    model = _llama()
    ids = torch.randint(4, 512, (16, 12), generator=torch.Generator().manual_seed(3))
    params = engine.SamplingParams(max_new_tokens=12, stop_token_ids=(1,))
    configure("onednn")
    kernels.use_onednn_linears(model)
    want = engine.HFEngine(model, 0).generate(ids, torch.ones_like(ids), list(range(16)), params)
    monkeypatch.setattr(torch.ops, "mkldnn", _Without(torch.ops.mkldnn, ["_reorder_linear_weight"]))
    backend, why = configure("onednn")
    assert backend == "onednn" and kernels._REORDER is None
    assert why == (
        "train.cpu_matmul = onednn; decode weights are not packed (this torch has no "
        "torch.ops.mkldnn._reorder_linear_weight (or no oneDNN))"
    )
    with kernels.packed_weights(model, rows=16) as n:
        assert n == 0
    got = engine.HFEngine(model, 0).generate(ids, torch.ones_like(ids), list(range(16)), params)
    assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["missing", "broken"])
def test_without_a_working_linear_operator_the_backend_is_blas(how, configure, monkeypatch):
    """A torch whose ``_linear_pointwise`` is gone or computes something else: "onednn" asked for
    gives "blas" and the reason; no model is routed, every product is torch's own."""
    name = "_linear_pointwise"
    fake = _Without(torch.ops.mkldnn, **{how: [name]})
    monkeypatch.setattr(torch.ops, "mkldnn", fake)
    backend, why = configure("onednn")
    assert backend == "blas" and not kernels.enabled()
    problem = (
        f"this torch has no torch.ops.mkldnn.{name} (or no oneDNN)"
        if how == "missing"
        else f"torch.ops.mkldnn.{name} gave a wrong test product"
    )
    assert why == f"train.cpu_matmul = onednn; but {problem}: torch's F.linear instead"
    model = _llama()
    assert kernels.use_onednn_linears(model) == 0
    x = torch.randn(512, 256)
    assert torch.equal(
        model.model.layers[0].mlp.up_proj(x),
        torch.nn.functional.linear(x, model.model.layers[0].mlp.up_proj.weight),
    )
