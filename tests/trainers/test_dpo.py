"""``proximal dpo`` and ``proximal simpo`` trained on tiny models; logged numbers checked independently.

The reference computations run each response alone through a plainly loaded
``AutoModelForCausalLM`` (no padding, no masks) and write the losses out with ``math``
(Rafailov et al. 2023, eq. 7; Meng et al. 2024, eq. 6).
"""

from __future__ import annotations

import gc
import json
import math
import random

import pytest
import torch
from ppo_support import TIMING_PREFIXES as TIMING

from proximal.config import load_config
from proximal.logging import read_metrics
from proximal.train import fixed
from proximal.train import run as run_module
from proximal.trainers.dpo import DPOConfig, SimPOConfig, train

CONFIGS = {"dpo": DPOConfig, "simpo": SimPOConfig}


def count_task(n: int, seed: int) -> list[dict]:
    """A digit and a space as the prompt; two a/b strings of 3–6 letters (so batches are padded), the one
    with more a's chosen (no ties). Learnable by raising the likelihood of 'a' relative to 'b'."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        x, y = ("".join(rng.choice("ab") for _ in range(rng.randint(3, 6))) for _ in range(2))
        if x.count("a") != y.count("a"):
            c, r = (x, y) if x.count("a") > y.count("a") else (y, x)
            rows.append({"prompt": f"{rng.randint(0, 9)} ", "chosen": c, "rejected": r})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_cfg(method, model_path, tmp_path, train_rows, eval_rows=None, **overrides):
    o = {
        "model.path": str(model_path),
        "data.train_file": write_jsonl(tmp_path / "train.jsonl", train_rows),
        "data.max_length": 16,
        "output.dir": str(tmp_path / "run"),
        "train.device": "cpu",
        "output.progress": False,
        **overrides,
    }
    if eval_rows is not None:
        o["data.eval_file"] = write_jsonl(tmp_path / "eval.jsonl", eval_rows)
    return load_config(CONFIGS[method], overrides={k: str(v) for k, v in o.items()})


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def plain_logps(model, tok, rows) -> list[tuple[list[float], list[float]]]:
    """Per-token log π(y_t | x, y_<t) of each side's response + EOS, each sequence alone, in float64."""
    out = []
    with torch.no_grad():
        for r in rows:
            p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            sides = []
            for key in ("chosen", "rejected"):
                y = tok(r[key], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                logp = torch.log_softmax(
                    model(input_ids=torch.tensor([p + y])).logits[0].double(), -1
                )
                sides.append([float(logp[len(p) + j - 1, target]) for j, target in enumerate(y)])
            out.append(tuple(sides))
    return out


def softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


@pytest.fixture(scope="module")
def llama(assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.policy("llama")
    return (
        path,
        AutoModelForCausalLM.from_pretrained(path).eval(),
        AutoTokenizer.from_pretrained(path),
    )


# --------------------------------------------------------------------------------------------------
# Learning, and the logged numbers recomputed by hand
# --------------------------------------------------------------------------------------------------


def test_dpo_learns_held_out_preferences_and_logs_what_it_computes(llama, tmp_path):
    base_path, base, tok = llama
    train_rows, eval_rows = count_task(256, seed=1), count_task(64, seed=2)
    beta = 0.5
    cfg = make_cfg(
        "dpo",
        base_path,
        tmp_path,
        train_rows,
        eval_rows,
        **{
            "dpo.beta": beta,
            "optim.lr": 3e-3,
            "train.steps": 24,
            "train.batch_size": 16,
            "train.micro_batch_size": 16,
            "train.eval_every": 12,
        },
    )
    out = train(cfg)
    rows = read_metrics(out / "metrics.jsonl")
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(evals) == [0, 12, 24]

    # Step 0: π_θ = π_ref, so every implicit reward is 0: loss ln 2, every pair a tie (counted wrong), KL 0.
    assert evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert (
        evals[0]["eval/accuracy"] == 0.0
        and evals[0]["eval/reward_margin"] == 0.0
        and evals[0]["eval/kl"] == 0.0
    )
    assert rows[0]["model/reference_resident"] == 1 and rows[0]["data/train_rows"] == 256
    final = evals[24]
    assert final["eval/accuracy"] >= 0.8  # chance is 0.5 (64 pairs: 0.8 by luck is p < 1e-5)
    assert final["eval/loss"] < 0.6 < math.log(2) and final["eval/reward_margin"] > 0.2
    assert final["eval/kl"] > 0

    # The exported policy, each held-out response alone, against the starting model: the logged numbers.
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(out).eval()
    pol, ref = plain_logps(policy, tok, eval_rows), plain_logps(base, tok, eval_rows)
    rw = [beta * (sum(p[0]) - sum(q[0])) for p, q in zip(pol, ref)]
    rl = [beta * (sum(p[1]) - sum(q[1])) for p, q in zip(pol, ref)]
    n = len(eval_rows)
    assert final["eval/reward_chosen"] == pytest.approx(sum(rw) / n, rel=1e-4)
    assert final["eval/reward_rejected"] == pytest.approx(sum(rl) / n, rel=1e-4)
    assert final["eval/accuracy"] == sum(w > lo for w, lo in zip(rw, rl)) / n
    assert final["eval/loss"] == pytest.approx(
        sum(softplus(-(w - lo)) for w, lo in zip(rw, rl)) / n, rel=1e-5
    )
    assert final["eval/logp_chosen"] == pytest.approx(sum(sum(p[0]) for p in pol) / n, rel=1e-5)

    # eval/kl: Σ_t Σ_v π_θ log(π_θ / π_ref) over each held-out response, mean over the 2n responses.
    kl = 0.0
    with torch.no_grad():
        for r in eval_rows:
            p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            for key in ("chosen", "rejected"):
                y = tok(r[key], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                x = torch.tensor([p + y])
                a = torch.log_softmax(policy(input_ids=x).logits[0, len(p) - 1 : -1].double(), -1)
                b = torch.log_softmax(base(input_ids=x).logits[0, len(p) - 1 : -1].double(), -1)
                kl += float((a.exp() * (a - b)).sum())
    assert final["eval/kl"] == pytest.approx(kl / (2 * n), rel=1e-4)


def test_simpo_learns_held_out_preferences_with_one_model(llama, tmp_path):
    base_path, _, tok = llama
    train_rows, eval_rows = count_task(256, seed=3), count_task(64, seed=4)
    beta, ratio = 2.0, 0.5
    cfg = make_cfg(
        "simpo",
        base_path,
        tmp_path,
        train_rows,
        eval_rows,
        **{
            "simpo.beta": beta,
            "simpo.gamma_beta_ratio": ratio,
            "optim.lr": 3e-3,
            "train.steps": 24,
            "train.batch_size": 16,
            "train.micro_batch_size": 16,
            "train.eval_every": 0,
            "train.eval_kl": False,
        },
    )
    out = train(cfg)
    rows = read_metrics(out / "metrics.jsonl")
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(evals) == [0, 24] and "eval/kl" not in evals[24]
    assert rows[0]["model/reference_resident"] == 0
    assert evals[24]["eval/accuracy"] >= 0.8 > evals[0]["eval/accuracy"] + 0.1

    from transformers import AutoModelForCausalLM

    pol = plain_logps(AutoModelForCausalLM.from_pretrained(out).eval(), tok, eval_rows)
    avg = [(sum(c) / len(c), sum(r) / len(r)) for c, r in pol]
    n = len(eval_rows)
    hand = sum(softplus(-(beta * (c - r) - ratio * beta)) for c, r in avg) / n
    assert evals[24]["eval/loss"] == pytest.approx(hand, rel=1e-5)
    assert evals[24]["eval/reward_chosen"] == pytest.approx(
        beta * sum(c for c, _ in avg) / n, rel=1e-5
    )
    assert evals[24]["eval/accuracy"] == sum(c > r for c, r in avg) / n


# --------------------------------------------------------------------------------------------------
# Batching, the reference, resume
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, extra",
    [
        ("dpo", {}),
        ("dpo", {"dpo.loss_type": "ipo"}),
        ("dpo", {"dpo.loss_type": "robust", "dpo.label_smoothing": 0.2}),
        ("simpo", {}),
    ],
)
def test_accumulation_equals_the_full_batch(llama, tmp_path, method, extra):
    """Two steps over 4 pairs of different lengths, as 1 micro-batch of 4 or 4 of 1: the same run."""
    base_path = llama[0]
    rows = count_task(8, seed=5)
    logged = {}
    for micro in (4, 1):
        d = tmp_path / f"m{micro}"
        d.mkdir()
        cfg = make_cfg(
            method,
            base_path,
            d,
            rows,
            **{
                "train.batch_size": 4,
                "train.micro_batch_size": micro,
                "train.steps": 2,
                "optim.lr": 1e-3,
                **extra,
            },
        )
        logged[micro] = [without_timing(r) for r in read_metrics(train(cfg) / "metrics.jsonl")]
    for a, b in zip(logged[4][1:], logged[1][1:]):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (a["step"], k)
    assert logged[4][1]["train/loss"] > 0


def test_precomputed_reference_gives_the_same_run(llama, tmp_path):
    base_path = llama[0]
    rows, eval_rows = count_task(12, seed=6), count_task(6, seed=7)
    logged = {}
    for pre in (False, True):
        d = tmp_path / f"pre{pre}"
        d.mkdir()
        cfg = make_cfg(
            "dpo",
            base_path,
            d,
            rows,
            eval_rows,
            **{
                "train.batch_size": 4,
                "train.micro_batch_size": 2,
                "train.steps": 3,
                "optim.lr": 1e-2,
                "train.eval_every": 1,
                "train.precompute_ref_logprobs": pre,
            },
        )
        logged[pre] = [without_timing(r) for r in read_metrics(train(cfg) / "metrics.jsonl")]
    assert (
        logged[False][0].pop("model/reference_resident") == 1
        and logged[True][0].pop("model/reference_resident") == 0
    )
    for a, b in zip(logged[False], logged[True]):
        assert a.keys() == b.keys()
        for k in (
            a
        ):  # the log-probabilities are the same function of the same weights, batched differently
            if (a["step"], k) in ((0, "eval/accuracy"), (1, "train/accuracy")):
                # Before the first update every pair is a tie (margin 0, counted wrong) on the fly; precomputed
                # in other batches, the margins are round-off (~1e-8) of either sign. Only the ties are checked.
                split = k.split("/")[0]
                assert a[k] == 0.0 and abs(b[f"{split}/reward_margin"]) < 1e-6
                continue
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a["step"], k)
    assert (
        logged[True][3]["eval/kl"] > 0
    )  # with no resident reference the starting model came back for the KL


def _resident_parameters() -> int:
    gc.collect()
    return sum(o.numel() for o in gc.get_objects() if torch.nn.Parameter in type(o).__mro__)


@pytest.mark.parametrize(
    "method, extra, models",
    [
        ("simpo", {}, 1),
        ("dpo", {"train.precompute_ref_logprobs": True}, 1),
        ("dpo", {}, 2),
        ("dpo", {"model.lora_r": 2}, 1),
    ],
)
def test_resident_models(llama, tmp_path, monkeypatch, method, extra, models):
    """At the optimiser step, count every parameter alive in the process: SimPO and DPO with precomputed
    reference log-probabilities hold one model, DPO with its reference two, DPO with LoRA one (plus the
    adapters: the reference is the same weights with the adapters off)."""
    base_path, base, _ = llama
    n_model = sum(p.numel() for p in base.parameters())
    seen = []

    def counting(*args, **kwargs):
        seen.append(_resident_parameters())
        return original(*args, **kwargs)

    original = fixed.clip_and_step  # the shared loop's step
    monkeypatch.setattr(fixed, "clip_and_step", counting)
    cfg = make_cfg(
        method,
        base_path,
        tmp_path,
        count_task(4, seed=8),
        count_task(2, seed=9),
        **{"train.batch_size": 4, "train.micro_batch_size": 4, "train.steps": 1, **extra},
    )
    before = _resident_parameters()
    train(cfg)
    adapters = seen[0] - before - models * n_model
    assert seen and (adapters == 0 if "model.lora_r" not in extra else 0 < adapters < n_model / 10)


class _Crash(Exception):
    pass


def test_resume_after_a_crash_reproduces_the_run(llama, tmp_path, monkeypatch):

    base_path = llama[0]
    rows, eval_rows = (
        count_task(10, seed=10),
        count_task(4, seed=11),
    )  # 4 pairs a step: resumes mid-pass

    def cfg(name):
        d = tmp_path / name
        d.mkdir()
        return make_cfg(
            "dpo",
            base_path,
            d,
            rows,
            eval_rows,
            **{
                "train.batch_size": 4,
                "train.micro_batch_size": 2,
                "train.steps": 4,
                "train.save_every": 2,
                "train.eval_every": 1,
                "optim.lr": 1e-2,
                "optim.warmup_steps": 3,
            },
        )

    full = train(cfg("full"))
    original = run_module.save_checkpoint

    def save_then_crash(root, step, **kwargs):
        out = original(root, step, **kwargs)
        if step == 2:
            raise _Crash
        return out

    monkeypatch.setattr(run_module, "save_checkpoint", save_then_crash)
    crashed_cfg = cfg("crashed")
    with pytest.raises(_Crash):
        train(crashed_cfg)
    monkeypatch.setattr(run_module, "save_checkpoint", original)
    resumed = train(crashed_cfg, resume_dir=crashed_cfg.output.dir)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(5))
    assert [without_timing(r) for r in a] == [
        without_timing(r) for r in b
    ]  # bitwise on CPU float32
    from safetensors.torch import load_file

    wa, wb = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bf16_mixed_runs(llama, tmp_path):
    cfg = make_cfg(
        "dpo",
        llama[0],
        tmp_path,
        count_task(4, seed=12),
        **{
            "train.batch_size": 4,
            "train.micro_batch_size": 2,
            "train.steps": 2,
            "train.precision": "bf16-mixed",
            "optim.lr": 1e-2,
        },
    )
    rows = read_metrics(train(cfg) / "metrics.jsonl")
    # a bfloat16 reference against the float32 policy under bfloat16 autocast: h ≈ 0, not exactly
    assert rows[1]["train/loss"] == pytest.approx(math.log(2), abs=1e-2)
    assert math.isfinite(rows[2]["train/loss"]) and rows[2]["train/loss"] != rows[1]["train/loss"]
