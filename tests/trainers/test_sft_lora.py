"""``proximal sft`` with ``model.lora_r``: only the adapters train (counted by hand from the model's
shapes), the frozen weights stay bit for bit, the run resumes exactly, and the export is either one
plain checkpoint with the adapters merged (``output.merge_lora``, the default; checked against
W + (α/r)·B·A computed here) or the adapters alone — and the next stage (``proximal dpo``) starts from
either."""

from __future__ import annotations

import json
import random

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from proximal.cli import main
from proximal.logging import read_metrics
from proximal.train import run as run_module
from proximal.trainers import sft

R, ALPHA = 2, 8.0
IDS = torch.tensor([[4, 5, 6, 7, 8, 9, 10]])


def _rows(path, n: int = 16):
    """Prompt "x=" with response "xxx" over the policy's letters."""
    rng = random.Random(0)
    rows = [
        {"prompt": f"{x} ", "response": x * 3} for x in (rng.choice("abcdefgh") for _ in range(n))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _argv(base, tmp_path, name, steps=2, *extra):
    data = _rows(tmp_path / "sft.jsonl")
    return [
        "sft",
        *("--model.path", str(base), "--model.lora_r", str(R), "--model.lora_alpha", str(ALPHA)),
        *("--data.train_file", data, "--data.eval_file", data, "--data.max_length", "16"),
        *("--optim.lr", "3e-2", "--optim.warmup_steps", "1", "--optim.schedule", "linear"),
        *("--train.steps", str(steps), "--train.batch_size", "8", "--train.micro_batch_size", "4"),
        *("--train.device", "cpu", "--train.save_every", "2"),
        *("--output.dir", str(tmp_path / name), "--output.progress", "false"),
        *extra,
    ]


@pytest.fixture
def trained(monkeypatch):
    """The model ``proximal sft`` trained, as it is after its last step (caught at the shared loop)."""
    seen = {}
    real_fit = sft.fit

    def fit(*args, model, **kw):
        seen["model"] = model
        return real_fit(*args, model=model, **kw)

    monkeypatch.setattr(sft, "fit", fit)
    return seen


def _adapter_count(config: dict) -> int:
    """r·(in + out) for each of q, k, v, o, gate, up, down in every block ('all-linear' skips lm_head)."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    per_block = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return R * per_block * config["num_hidden_layers"]


def test_only_the_adapters_train_and_the_base_stays_bit_for_bit(assets, tmp_path, trained, capsys):
    base = assets.policy("llama")
    argv = _argv(base, tmp_path, "run", 2, "--output.merge_lora", "false")
    assert main(argv) == 0, capsys.readouterr().err
    model = trained["model"]
    config = json.loads((base / "config.json").read_text())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == _adapter_count(config) == 2944
    # every frozen weight is the checkpoint's, to the bit; the adapters moved (B starts at 0)
    original = load_file(str(base / "model.safetensors"))
    frozen = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): p
        for n, p in model.named_parameters()
        if not p.requires_grad
    }
    assert frozen.keys() == original.keys()
    assert all(torch.equal(frozen[k], original[k]) for k in original)
    assert all(p.abs().max() > 0 for n, p in trainable.items() if ".lora_B." in n)

    # the unmerged export: adapters only, loaded over model.path by peft, the trained model's outputs
    out = tmp_path / "run"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    with torch.no_grad():
        torch.testing.assert_close(
            adapted(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=0
        )


def test_the_merged_export_is_a_plain_model_and_dpo_starts_from_it(
    assets, tmp_path, trained, capsys
):
    base = assets.policy("llama")
    assert main(_argv(base, tmp_path, "run", 2)) == 0, capsys.readouterr().err
    model, out = trained["model"], tmp_path / "run"
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    # each adapted weight is W + (α/r)·B·A, every other weight the base's
    original = load_file(str(base / "model.safetensors"))
    params = dict(model.named_parameters())
    merged = plain.state_dict()
    adapted = 0
    for key, w in original.items():
        stem = "base_model.model." + key.removesuffix(".weight")
        if f"{stem}.lora_A.default.weight" in params:
            a, b = params[f"{stem}.lora_A.default.weight"], params[f"{stem}.lora_B.default.weight"]
            want = w.double() + ALPHA / R * (b.double() @ a.double())
            torch.testing.assert_close(merged[key].double(), want, rtol=0, atol=1e-6)
            assert not torch.equal(merged[key], w)
            adapted += 1
        else:
            assert torch.equal(merged[key], w), key
    assert adapted == 7 * 2
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=1e-5, atol=1e-5
        )
    # each checkpoint's export is merged the same way
    ckpt = out / "checkpoints" / "step_000002" / "model"
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "adapter_config.json").exists()

    # the next stage: DPO from the merged export, and from the adapters alone
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"{x} ", "chosen": x * 3, "rejected": x + "b"}) + "\n"
            for x in "acdefgh" * 2
        )
    )
    for path in (out, tmp_path / "adapters"):
        if path != out:
            assert main(_argv(base, tmp_path, "adapters", 2, "--output.merge_lora", "false")) == 0
        dpo = [
            "dpo",
            *("--model.path", str(path), "--data.train_file", str(pairs)),
            *("--data.max_length", "16", "--train.steps", "1", "--train.batch_size", "4"),
            *("--train.micro_batch_size", "4"),
            *("--train.device", "cpu", "--output.progress", "false"),
            *("--output.dir", str(tmp_path / f"dpo_{path.name}")),
        ]
        assert main(dpo) == 0, capsys.readouterr().err
        assert read_metrics(tmp_path / f"dpo_{path.name}" / "metrics.jsonl")[-1]["step"] == 1


def _without_time(rows):
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "memory/"))}
        for r in rows
    ]


def test_a_lora_run_resumes_exactly(assets, tmp_path, monkeypatch, capsys):
    """Killed right after the step-2 checkpoint and resumed: the metrics of steps 3–4 and the merged
    export are the uninterrupted run's, to the bit (adapters, AdamW moments, schedule restored)."""
    base = assets.policy("llama")
    assert main(_argv(base, tmp_path, "full", 4)) == 0, capsys.readouterr().err
    original = run_module.save_checkpoint

    def save_then_crash(root, step, **kw):
        out = original(root, step, **kw)
        if step == 2:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(run_module, "save_checkpoint", save_then_crash)
    assert main(_argv(base, tmp_path, "crashed", 4)) == 130
    monkeypatch.setattr(run_module, "save_checkpoint", original)
    assert main(["sft", "--resume", str(tmp_path / "crashed")]) == 0, capsys.readouterr().err
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "crashed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert _without_time(resumed) == _without_time(full)
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "crashed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
