"""Fixtures shared by every test directory: tiny models, tokenizers and prompt files, built once, on disk.

Everything is made here with :mod:`proximal.models.tiny` and saved in Hugging Face format, so the
trainers load it through the same ``from_pretrained`` path a user's checkpoint takes; nothing is
downloaded. Models are built lazily (a test that needs GPT-2 builds GPT-2).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# tests/multiproc.py; reward functions are configured as 'ppo_support:<name>'
for sub in ("", "trainers/ppo"):
    if str(HERE / sub) not in sys.path:
        sys.path.insert(0, str(HERE / sub))

from ppo_support import ALPHABET, prompt_texts  # noqa: E402

# Every run measures its peak FLOP/s for perf/mfu: a one-second matrix-product probe per process on a
# CPU. The suite starts hundreds of runs, so they take a given figure instead (inherited by the
# subprocesses); tests/train/test_perf.py clears it to test the probe itself.
os.environ.setdefault("PROXIMAL_PEAK_FLOPS", "1e11")

# train.cpu_matmul: auto measures oneDNN against torch's BLAS when a run starts (issue 27,
# proximal.models.kernels), so where the two are close its choice could change from one process to
# the next — and a test comparing two runs' numbers would compare two backends' roundings. The suite
# pins torch's BLAS here, in one place (the subprocesses inherit it); the tests of the choice itself
# unset it and inject the probe's timings (tests/models/test_kernels.py,
# tests/train/test_train_run_records.py).
os.environ.setdefault("PROXIMAL_CPU_MATMUL", "blas")

# Under pytest-xdist (`make test` runs two workers) each worker computes on one thread, and so do the
# runs it starts: two workers of two threads each on two cores would wait on each other's threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch  # noqa: E402

    torch.set_num_threads(1)

# The vLLM engine's tests (marked `vllm`) run in .venv-vllm (`make test-vllm`, in one process: an
# engine takes over process-wide state). Anywhere vllm is not installed they are skipped, saying so.
VLLM_MISSING = importlib.util.find_spec("vllm") is None


def pytest_collection_modifyitems(config, items):
    if not VLLM_MISSING:
        return
    skip = pytest.mark.skip(
        reason="vllm is not installed: make test-vllm runs these in .venv-vllm (docs/engines.md)"
    )
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


# A second tokenizer for a reward model: other special-token strings, the alphabet reversed (so every
# id differs from the policy's) and a few characters the policy never writes.
OTHER_ALPHABET = "9876543210 hgfedcbaxyz"
OTHER_SPECIALS = ("[PAD]", "[EOS]", "[BOS]", "[UNK]")


class Assets:
    """Tiny checkpoints and data files under one session temp dir; each built on first use."""

    def __init__(self, root: Path):
        self.root = root

    @functools.cached_property
    def tokenizer(self):
        from proximal.models.tiny import build_char_tokenizer

        return build_char_tokenizer(list(ALPHABET))

    @functools.cached_property
    def other_tokenizer(self):
        from proximal.models.tiny import build_char_tokenizer

        return build_char_tokenizer(list(OTHER_ALPHABET), specials=OTHER_SPECIALS)

    @functools.cache  # noqa: B019 - one instance, alive for the whole session
    def policy(self, arch: str = "llama") -> Path:
        from proximal.models.tiny import build_tiny_causal_lm

        return build_tiny_causal_lm(self.root / f"policy_{arch}", self.tokenizer, arch=arch, seed=0)

    @functools.cache  # noqa: B019 - one instance, alive for the whole session
    def reward_model(self, arch: str = "llama") -> Path:
        from proximal.models.tiny import build_tiny_reward_model

        return build_tiny_reward_model(self.root / f"rm_{arch}", self.tokenizer, arch=arch, seed=1)

    @functools.cached_property
    def other_tokenizer_reward_model(self) -> Path:
        """A GPT-2 reward model whose tokenizer differs from the policy's in every id and special token."""
        from proximal.models.tiny import build_tiny_reward_model

        return build_tiny_reward_model(
            self.root / "rm_other_tok", self.other_tokenizer, arch="gpt2", seed=2
        )

    @functools.cached_property
    def two_label_reward_model(self) -> Path:
        from proximal.models.tiny import build_tiny_reward_model

        return build_tiny_reward_model(
            self.root / "rm_2labels", self.tokenizer, arch="llama", num_labels=2
        )

    @functools.cached_property
    def no_pad_policy(self) -> Path:
        """A policy saved with a tokenizer that has no pad token (as many base LMs ship)."""
        from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm

        tok = build_char_tokenizer(list(ALPHABET))
        tok.pad_token = None
        assert tok.pad_token_id is None
        return build_tiny_causal_lm(self.root / "policy_no_pad", tok, arch="llama", seed=0)

    @functools.cached_property
    def prompts(self) -> Path:
        from proximal.data.jsonl import write_jsonl

        path = self.root / "prompts.jsonl"
        write_jsonl(path, [{"prompt": p} for p in prompt_texts()])
        return path


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    return Assets(tmp_path_factory.mktemp("assets"))
