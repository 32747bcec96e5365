"""The benchmark works (issues 12 and 22) and the models and prompts they run on, written to disk here.

Every work names a model shape (Llama, or Qwen2 for the real-vocabulary works), a prompt length P, a
batch B and a response length R. Both sides read the same two checkpoints: one causal LM (policy and
reference) and one one-label ``AutoModelForSequenceClassification`` (reward model and critic / value
model).

**Exactly R tokens per response, on both sides.** proximal always stops a row at the tokenizer's EOS
(``proximal/rollout/sampling.py``: ``eos = [tokenizer.eos_token_id] + stop_token_ids``) and has no
switch to forbid it; TRL's PPOTrainer treats the first *pad* token of a response as its end
(``first_true_indices(response == pad_token_id)``), and Hugging Face ``generate`` falls back to the
model's EOS. So the benchmark policy is built so that it cannot sample any special token (pad, EOS,
BOS, unk): :func:`forbid_tokens` dedicates one hidden dimension k to a constant C that no layer
reads or writes, and gives the special tokens' output rows −M there, so their logits sit about
``n_k·(C+M)`` ≈ 1000 nats below every other token's. Their softmax probability is exactly 0 in float32
and bfloat16, and neither TRL's multinomial nor proximal's inverse-CDF sampler draws a token of
probability 0, so neither side can ever draw one: every response is R tokens, on
identical arithmetic (the shapes are those of the issue; only the values of a few weights differ
from a plain random initialisation). Ten steps at lr 1e-5 move those weights by ~1e-4.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import string
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Work:
    """One benchmark work: a model shape, the batch and the lengths."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    tied: bool
    prompt_len: int  # P: every prompt is exactly this many tokens
    batch: int  # B: sequences sampled per step (PPO); prompts per step x group_size (GRPO)
    response_len: int  # R: every response is exactly this many tokens
    precision: str = "32-true"  # proximal's train.precision; TRL bf16 = precision != "32-true"
    method: str = "ppo"  # ppo | grpo
    group_size: int = 1  # GRPO: completions per prompt
    seed: int = 0
    arch: str = "llama"  # llama | qwen2 (a transformers model type with Llama's block layout)
    kv_heads: int | None = None  # key/value heads (grouped-query attention); None = heads
    steps: int = 10  # training steps a run when compare_trl.py's --steps is not given

    @property
    def bf16(self) -> bool:
        return self.precision != "32-true"

    def model_key(self) -> str:
        """The fields that decide the checkpoints: works that share them share the files."""
        kv = f"-kv{self.kv_heads}" if self.kv_heads not in (None, self.heads) else ""
        return (
            f"{self.arch}-v{self.vocab}-h{self.hidden}-l{self.layers}-a{self.heads}{kv}"
            f"-i{self.intermediate}-{'tied' if self.tied else 'untied'}-s{self.seed}"
        )


TINY = Work(
    "tiny",
    vocab=2048,
    hidden=256,
    layers=4,
    heads=4,
    intermediate=1024,
    tied=True,
    prompt_len=16,
    batch=16,
    response_len=48,
)
# The issue does not say whether wide-vocab ties its embeddings; Llama's default (and Llama-2's 32000-token
# checkpoints) is untied, so the vocabulary-sized output layer is a separate 32000 x 512 matrix.
WIDE = Work(
    "wide",
    vocab=32000,
    hidden=512,
    layers=6,
    heads=8,
    intermediate=2048,
    tied=False,
    prompt_len=32,
    batch=32,
    response_len=64,
)
# GRPO on tiny: 4 prompts x 4 completions = 16 sequences a step, the same sequence count and lengths as PPO tiny.
GRPO_TINY = replace(TINY, name="grpo", method="grpo", group_size=4)
# A minuscule work for CI's smoke run (tests/test_benchmarks.py): seconds, not a measurement.
MINI = Work(
    "mini",
    vocab=256,
    hidden=32,
    layers=2,
    heads=2,
    intermediate=64,
    tied=True,
    prompt_len=8,
    batch=4,
    response_len=8,
)

# Issue 22: a real vocabulary. Qwen2's 151,936 ids (Qwen2/2.5 at every size) on a small Qwen2 body —
# hidden 128, 2 layers, 4 query heads over 2 key/value heads, tied embeddings as Qwen2-0.5B's — so the
# vocabulary-sized tensors (the head's products, the logits and their gradients) are what a step is
# about, on 2 cores in seconds. The shape of the wide work's batch: 32 prompts of 32 tokens, responses
# of 64. A TRL step takes about a minute here, so a run is 3 steps (the median of steps 2-3): the
# 3-round invocation of both works stays near 15 minutes on 2 cores.
QWEN_VOCAB = 151_936
PPO_VOCAB = Work(
    "ppo-vocab",
    vocab=QWEN_VOCAB,
    hidden=128,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=512,
    tied=True,
    prompt_len=32,
    batch=32,
    response_len=64,
    arch="qwen2",
    steps=3,
)
# GRPO on the same model and the same sequences a step: 8 prompts x 4 completions = 32 of 32 + 64 tokens.
GRPO_VOCAB = replace(PPO_VOCAB, name="grpo-vocab", method="grpo", group_size=4)
# A minuscule qwen2 work for quick checks of the qwen2 path (tokenizer with the vocabulary in its BPE table).
MINI_QWEN = replace(MINI, name="mini-qwen2", arch="qwen2", vocab=4096, heads=2, kv_heads=1)

WORKS: dict[str, Work] = {
    "tiny": TINY,
    "wide": WIDE,
    "tiny-bf16": replace(TINY, name="tiny-bf16", precision="bf16-mixed"),
    "wide-bf16": replace(WIDE, name="wide-bf16", precision="bf16-mixed"),
    "grpo": GRPO_TINY,
    "ppo-vocab": PPO_VOCAB,
    "grpo-vocab": GRPO_VOCAB,
    "mini": MINI,
    "mini-grpo": replace(MINI, name="mini-grpo", method="grpo", group_size=2),
    "mini-qwen2": MINI_QWEN,
}
DEFAULT_WORKS = ("tiny", "wide", "tiny-bf16", "wide-bf16", "grpo", "ppo-vocab", "grpo-vocab")

#: Context of every benchmark model (prompt + response must fit; the scaling sweep goes to 16 + 256).
MAX_POSITIONS = 1024

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3, as in proximal.models.tiny
# The characters prompts are written in: printable ASCII without '<' and '>' (the extra vocabulary
# entries are spelled "<tN>", so a prompt can never contain one by accident).
ALPHABET = [
    c
    for c in string.ascii_letters + string.digits + " .,;:!?-+*/=()[]{}'\"#$%&@^_`|~"
    if c not in "<>"
]


def with_precision(work: Work, precision: str) -> Work:
    return replace(work, precision=precision) if work.bf16 else work


def build_tokenizer(vocab: int, arch: str = "llama"):
    """A byte-level fast tokenizer of exactly ``vocab`` ids: the 4 specials, one id per character of
    :data:`ALPHABET`, then ``<t0>``, ``<t1>``, … Prompts use the characters only, so text and ids
    round-trip exactly; the model may sample any non-special id.

    For Llama works the ``<tN>`` are added tokens (as the issue-12 works were measured). For Qwen2 they
    are entries of the BPE table itself, reachable by no merge — the form of a real Qwen2 vocabulary
    (151,643 BPE entries): transformers rebuilds a ``qwen2`` checkpoint's tokenizer as
    ``Qwen2Tokenizer`` from its vocabulary and merges, and 150,000 added tokens would also make every
    load build a matcher over them.
    """
    if arch == "qwen2":
        return _bpe_tokenizer(vocab)
    from proximal.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(ALPHABET, specials=SPECIALS)
    extra = vocab - len(tok)
    if extra < 0:
        raise ValueError(
            f"vocab {vocab} is smaller than the {len(tok)} ids of the character alphabet"
        )
    if extra:
        tok.add_tokens([f"<t{i}>" for i in range(extra)])
    if len(tok) != vocab:
        raise AssertionError(f"tokenizer has {len(tok)} ids, wanted {vocab}")
    return tok


def _bpe_tokenizer(vocab: int):
    """:func:`build_tokenizer` for Qwen2: the characters and ``<tN>`` all in a no-merge BPE table."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from proximal.models.tiny import _bytes_to_unicode

    symbol = _bytes_to_unicode()
    table = {t: i for i, t in enumerate(SPECIALS)}
    for c in ALPHABET:
        table[symbol[ord(c)]] = len(table)
    if vocab < len(table):
        raise ValueError(
            f"vocab {vocab} is smaller than the {len(table)} ids of the character alphabet"
        )
    for i in range(vocab - len(table)):
        table[f"<t{i}>"] = len(table)
    tok = Tokenizer(models.BPE(vocab=table, merges=[], unk_token=SPECIALS[3]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    pad, eos, bos, unk = SPECIALS
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, eos_token=eos, bos_token=bos, unk_token=unk
    )
    if len(fast) != vocab:
        raise AssertionError(f"tokenizer has {len(fast)} ids, wanted {vocab}")
    return fast


def model_config(work: Work, tok, *, num_labels: int | None = None):
    """The transformers config of ``work``'s model: Llama's, or Qwen2's (the same block layout, with
    biases on the query/key/value projections) for ``arch: qwen2``."""
    from transformers import LlamaConfig, Qwen2Config

    kw = {} if num_labels is None else {"num_labels": num_labels}
    if work.arch not in ("llama", "qwen2"):
        raise ValueError(f"{work.name}: unknown arch {work.arch!r} (llama or qwen2)")
    cls = Qwen2Config if work.arch == "qwen2" else LlamaConfig
    return cls(
        vocab_size=work.vocab,
        hidden_size=work.hidden,
        num_hidden_layers=work.layers,
        num_attention_heads=work.heads,
        num_key_value_heads=work.kv_heads or work.heads,
        intermediate_size=work.intermediate,
        tie_word_embeddings=work.tied,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        **kw,
    )


def forbid_tokens(model, token_ids: list[int], *, big: float = 1000.0) -> float:
    """Make ``token_ids`` unreachable for sampling from this Llama or Qwen2 causal LM (see the module
    docstring; both write the residual stream only through ``o_proj`` and ``down_proj`` and read it
    only through their RMS norms, whose weights are zeroed at dimension k);
    returns the smallest logit gap (allowed minus forbidden) on a probe batch, in nats."""
    import torch

    inner = model.model
    d = model.config.hidden_size
    k = d - 1
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    with torch.no_grad():
        c = float(emb.std()) * math.sqrt(
            d
        )  # about as large as the rest of a token's embedding together
        emb[:, k] = c
        if out.data_ptr() != emb.data_ptr():
            out[:, k] = c
        out[token_ids, k] = -big  # tied: the input rows of the specials too (never read:
        for layer in inner.layers:  # they occur only as masked padding)
            layer.self_attn.o_proj.weight[k, :] = 0  # no layer writes dimension k ...
            layer.mlp.down_proj.weight[k, :] = 0
            layer.input_layernorm.weight[k] = 0  # ... or reads it
            layer.post_attention_layernorm.weight[k] = 0
        inner.norm.weight[k] = 1.0
        g = torch.Generator().manual_seed(0)
        allowed = sorted(set(range(model.config.vocab_size)) - set(token_ids))
        probe = torch.tensor(allowed)[torch.randint(len(allowed), (4, 24), generator=g)]
        logits = model(input_ids=probe).logits
        gap = logits[..., allowed].min(-1).values - logits[..., token_ids].max(-1).values
    return float(gap.min())


def _fingerprint(work: Work) -> str:
    return hashlib.sha256(
        json.dumps([work.model_key(), ALPHABET, SPECIALS, MAX_POSITIONS, 3]).encode()
    ).hexdigest()[:16]


def write_models(work: Work, root: Path) -> dict:
    """The policy checkpoint (``policy/``) and the one-label classifier (``reward/``) of ``work`` under
    ``root/models/<model key>``, written once and reused while their recipe is unchanged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = root / "models" / work.model_key()
    manifest = out / "manifest.json"
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        if m.get("fingerprint") == _fingerprint(work):
            return m
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = build_tokenizer(work.vocab, work.arch)
    specials = [tok.convert_tokens_to_ids(s) for s in SPECIALS]
    torch.manual_seed(work.seed)
    policy = AutoModelForCausalLM.from_config(model_config(work, tok))
    gap = forbid_tokens(policy, specials)
    if gap < 200:
        raise AssertionError(
            f"{work.name}: the special tokens are only {gap:.0f} nats below the rest"
        )
    policy.generation_config.pad_token_id = tok.pad_token_id
    policy.generation_config.eos_token_id = tok.eos_token_id
    policy.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")
    torch.manual_seed(work.seed + 1)
    rm = AutoModelForSequenceClassification.from_config(model_config(work, tok, num_labels=1))
    rm.save_pretrained(out / "reward")
    tok.save_pretrained(out / "reward")
    m = {
        "fingerprint": _fingerprint(work),
        "policy": str(out / "policy"),
        "reward": str(out / "reward"),
        "special_ids": specials,
        "min_logit_gap": gap,
        "params_policy": sum(p.numel() for p in policy.parameters()),
        "params_reward": sum(p.numel() for p in rm.parameters()),
    }
    manifest.write_text(json.dumps(m, indent=1))
    return m


def write_prompts(work: Work, root: Path, n_prompts: int, policy_dir: str) -> dict:
    """``n_prompts`` prompts of exactly ``work.prompt_len`` tokens: JSONL text for proximal, the same ids
    as JSON for TRL — checked to be identical through the loaded tokenizer, the way proximal encodes."""
    from transformers import AutoTokenizer

    rng = random.Random(1000 + work.seed)
    texts = [
        "".join(rng.choice(ALPHABET) for _ in range(work.prompt_len)) for _ in range(n_prompts)
    ]
    tok = AutoTokenizer.from_pretrained(policy_dir)
    if len(tok) != work.vocab:
        raise AssertionError(f"the saved tokenizer has {len(tok)} ids, the model {work.vocab}")
    ids = [list(tok(t, add_special_tokens=True)["input_ids"]) for t in texts]
    bad = [i for i, x in enumerate(ids) if len(x) != work.prompt_len]
    if bad:
        raise AssertionError(
            f"prompt {bad[0]} tokenizes to {len(ids[bad[0]])} ids, not {work.prompt_len}"
        )
    d = root / "prompts" / f"{work.model_key()}-p{work.prompt_len}-n{n_prompts}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    (d / "prompt_ids.json").write_text(json.dumps(ids))
    return {"jsonl": str(d / "prompts.jsonl"), "ids": str(d / "prompt_ids.json"), "n": n_prompts}


def describe(work: Work) -> dict:
    return asdict(work)
