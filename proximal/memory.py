"""GPU memory planner for PPO's four models: the memory budget of their weights, AdamW states,
gradients and activations, as documented formulas.

``proximal memory --params 70e9`` or ``proximal memory --config path/to/model`` answers the first
question of a PPO run — do the actor, critic, reference and reward model fit? — before any GPU is
rented. Everything here is integer arithmetic on a model's shape: no torch, no model loading, no
network. The derivation of every term, what is deliberately not counted, and the measured-versus-
predicted check live in ``docs/memory.md``; ``benchmarks/memory_check.py`` re-runs that check.

Notation (used in every docstring below):

    N   parameters of one model          b   bytes per element of the chosen --dtype (2 or 4)
    L   transformer layers               h   hidden size
    q   query width, heads * head_dim    kv  key/value width, kv_heads * head_dim (GQA)
    I   MLP intermediate size            V   vocabulary size
    P   prompt tokens    T   response tokens    s = P + T   tokens of one sequence
    B   rollout sequences on one GPU     m   training micro-batch (sequences) on one GPU
    W   GPUs holding one shard each (FSDP world size)

Bytes per parameter (for 16-bit, the usual mixed-precision AdamW budget of Rajbhandari et al. 2020;
float32 is the apples-to-apples CPU variant)::

                      weights  gradients  AdamW state
    bfloat16/float16     2         2      12 = float32 master copy 4 + first moment 4 + second moment 4
    float32              4         4       8 = first moment 4 + second moment 4 (the weights are the master)

Frozen models (reference, reward) hold weights only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GiB = 2**30
UNITS = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6}
DTYPES = ("bfloat16", "float16", "float32")
STRATEGIES = ("single", "fsdp", "offload", "fsdp-offload")
ROLES = ("actor", "critic", "reference", "reward")

# (weights, gradients, optimizer) bytes per trainable parameter; see the module docstring.
_PER_PARAM = {2: (2, 2, 12), 4: (4, 4, 8)}
# Bytes per element of the log-probability path: every RLHF library upcasts logits to float32 before
# the log-softmax, whatever the model dtype (16-bit log-softmax over 100k+ tokens loses the ratio).
LOGIT_BYTES = 4


def dtype_bytes(dtype: str) -> int:
    """2 for bfloat16/float16, 4 for float32."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return 4 if dtype == "float32" else 2


# --------------------------------------------------------------------------------------------------
# Model shapes: parameter count, activations per token, KV cache per token
# --------------------------------------------------------------------------------------------------

# Llama-style decoders (RMSNorm, rotary positions, SwiGLU MLP). Bias flags name the config key that
# switches them, or a constant where the architecture fixes it.
_LLAMA_FAMILY = {
    "llama": dict(
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", qk_norm=False
    ),
    "mistral": dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": dict(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True),
}
SUPPORTED_MODEL_TYPES = tuple(_LLAMA_FAMILY) + ("gpt2",)


class ConfigReadError(ValueError):
    """A config.json could not be read or lacks a field; the message names the path and the field."""


@dataclass(frozen=True)
class Architecture:
    """The shape of a decoder-only transformer, enough to count its parameters and size its memory.

    ``gated_mlp``/``rms_norm`` distinguish the Llama family (SwiGLU, RMSNorm) from GPT-2 (GELU MLP,
    LayerNorm); ``positions`` is the size of a learned absolute position table (GPT-2), else 0.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    gated_mlp: bool = True
    rms_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    positions: int = 0
    source: str = ""

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- parameters ----------------------------------------------------------------------------

    def linear_shapes(self) -> list[tuple[int, int, bool]]:
        """(in, out, bias) of every linear layer in one transformer layer: the LoRA targets."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attn = [
            (h, q, self.qkv_bias),
            (h, kv, self.qkv_bias),
            (h, kv, self.qkv_bias),
            (q, h, self.o_bias),
        ]
        if self.gated_mlp:
            mlp = [
                (h, i, self.mlp_bias),
                (h, i, self.mlp_bias),
                (i, h, self.mlp_bias),
            ]  # gate, up, down
        else:
            mlp = [(h, i, True), (i, h, True)]  # GPT-2: c_fc, c_proj (always biased)
        return attn + mlp

    def layer_params(self) -> int:
        """Parameters of one transformer layer: attention, MLP, two norms (+ q/k norms for Qwen3)."""
        linear = sum(i * o + (o if bias else 0) for i, o, bias in self.linear_shapes())
        norm = self.hidden_size if self.rms_norm else 2 * self.hidden_size  # LayerNorm has a bias
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return linear + 2 * norm + qk_norm

    def backbone_params(self) -> int:
        """Embeddings (+ learned positions) + L layers + the final norm; no output head."""
        final_norm = self.hidden_size if self.rms_norm else 2 * self.hidden_size
        return (
            (self.vocab_size + self.positions) * self.hidden_size
            + self.num_layers * self.layer_params()
            + final_norm
        )

    def params(self, head: str) -> int:
        """N for a model with this backbone and ``head``.

        ``lm``: the language-model head, V*h unless tied to the input embedding (then it adds nothing).
        ``score``: the one-label scalar head of ``AutoModelForSequenceClassification`` (h weights, no
        bias) — proximal's reward model and critic (``proximal.models.heads``).
        """
        if head == "lm":
            return self.backbone_params() + (
                0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
            )
        if head == "score":
            return self.backbone_params() + self.hidden_size
        raise ValueError(f"head {head!r} is not 'lm' or 'score'")

    def lora_params(self, rank: int) -> int:
        """LoRA adapter parameters at ``rank`` on every linear layer of every transformer layer.

        One adapter on a linear layer in->out is A (rank x in) + B (out x rank): rank*(in + out).
        This is PEFT's ``target_modules="all-linear"`` (which skips the output head).
        """
        return self.num_layers * sum(rank * (i + o) for i, o, _ in self.linear_shapes())

    # ---- activations ---------------------------------------------------------------------------

    def saved_elements_per_token_layer(self) -> int:
        """Elements autograd keeps for backward, per token, in one transformer layer (no checkpointing).

        Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
        §4.1, counts the tensors each op saves for its backward; we apply the same method to the
        Llama block as Hugging Face implements it, with a fused attention kernel (flash or SDPA):

            2 norms, each: its input x, the normalised x, the output (saved by the next linear)   2 * 3h
            attention: the kernel's inputs q (rotated), k, v and its output; the contiguous copy
                       of the output that o_proj saves                                           3q + 2kv
            SwiGLU MLP: gate output, SiLU output, up output, their product (saved by down_proj)    4I
                                                                                          = 6h + 3q + 2kv + 4I
        The rotary embedding saves only cos/sin (shared), residual adds save nothing, and a fused
        kernel stores a log-sum-exp per head instead of the s x s attention matrix, so Korthikanti's
        5*a*s/h term is absent. GPT-2, by the same count: LayerNorm saves x and its output (2h, its
        mean and 1/std are per token), a fused GELU MLP saves the c_fc and GELU outputs (2I):
        4h + 3q + 2kv + 2I.
        """
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        norm = 3 * h if self.rms_norm else 2 * h
        mlp = 4 * i if self.gated_mlp else 2 * i
        return 2 * norm + (q + 2 * kv) + 2 * q + mlp

    def activation_bytes_per_token_layer(self, b: int) -> int:
        """Bytes of ``saved_elements_per_token_layer`` at ``b`` bytes per element.

        Hugging Face's RMSNorm upcasts its input to float32 and saves that copy, so in 16-bit each of
        the two norms keeps x at 4 bytes, not b: (4 - b) * h extra bytes per norm.
        """
        upcast = 2 * (4 - b) * self.hidden_size if self.rms_norm else 0
        return b * self.saved_elements_per_token_layer() + upcast

    def final_norm_bytes_per_token(self, b: int) -> int:
        """The final norm's saved tensors (as one norm above); its output feeds the head."""
        if not self.rms_norm:
            return b * 2 * self.hidden_size
        return b * 3 * self.hidden_size + (4 - b) * self.hidden_size

    def forward_working_bytes_per_token(self, b: int) -> int:
        """Live bytes per token inside one layer of a no-grad forward (nothing is saved between layers).

        The largest moment is the MLP: the residual x and the normed input, and — gated — the SiLU
        output, the up output and their product (the gate output is freed by then): 2h + 3I.
        GELU MLP: 2h + 2I.
        """
        mlp = 3 * self.intermediate_size if self.gated_mlp else 2 * self.intermediate_size
        return b * (2 * self.hidden_size + mlp)

    def kv_bytes_per_token(self, b: int) -> int:
        """KV cache per token of one sequence: keys and values in every layer, 2 * L * kv * b."""
        return 2 * self.num_layers * self.kv_dim * b

    def largest_unit_params(self) -> int:
        """Parameters of the largest FSDP unit (wrapping each layer; embeddings/head as their own)."""
        return max(self.layer_params(), self.vocab_size * self.hidden_size)


def _get(cfg: dict, path: str, *keys: str, default=None, required: bool = True):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is not None or not required:
        return default
    raise ConfigReadError(f"{path}: config has no {' / '.join(keys)} field")


def read_config(path: str | Path) -> tuple[dict, str]:
    """The dict in ``path`` (a config.json, or a model directory holding one) and the file read."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        where = f"no config.json in directory {p}" if p.is_dir() else f"no such file {p}"
        raise ConfigReadError(f"{path}: {where}")
    try:
        return json.loads(file.read_text()), str(file)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigReadError(f"{file}: not a readable JSON config: {e}") from e


def architecture_from_config(cfg: dict, source: str = "config") -> Architecture:
    """An ``Architecture`` from a Hugging Face config dict (Llama, Mistral, Qwen2, Qwen3 or GPT-2)."""
    mt = cfg.get("model_type")
    if mt == "gpt2":
        h = _get(cfg, source, "n_embd", "hidden_size")
        return Architecture(
            model_type=mt,
            vocab_size=_get(cfg, source, "vocab_size"),
            hidden_size=h,
            num_layers=_get(cfg, source, "n_layer", "num_hidden_layers"),
            num_heads=_get(cfg, source, "n_head", "num_attention_heads"),
            num_kv_heads=_get(cfg, source, "n_head", "num_attention_heads"),
            head_dim=h // _get(cfg, source, "n_head", "num_attention_heads"),
            intermediate_size=_get(cfg, source, "n_inner", default=4 * h),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            gated_mlp=False,
            rms_norm=False,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            positions=_get(cfg, source, "n_positions", "max_position_embeddings"),
            source=source,
        )
    if mt in _LLAMA_FAMILY:
        flags = {
            k: (bool(cfg.get(v, False)) if isinstance(v, str) else v)
            for k, v in _LLAMA_FAMILY[mt].items()
        }
        h = _get(cfg, source, "hidden_size")
        heads = _get(cfg, source, "num_attention_heads")
        return Architecture(
            model_type=mt,
            vocab_size=_get(cfg, source, "vocab_size"),
            hidden_size=h,
            num_layers=_get(cfg, source, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_get(cfg, source, "num_key_value_heads", default=heads),
            head_dim=_get(cfg, source, "head_dim", default=h // heads),
            intermediate_size=_get(cfg, source, "intermediate_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            source=source,
            **flags,
        )
    raise ConfigReadError(
        f"{source}: model_type {mt!r} is not supported; the planner knows "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (pass --params N to size weights and "
        "optimizer state only)"
    )


def load_architecture(path: str | Path) -> Architecture:
    """Read ``path`` (a model directory or its config.json) with plain ``json``; never downloads."""
    cfg, file = read_config(path)
    return architecture_from_config(cfg, source=file)


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One of the four models: its shape (``arch``) or, lacking one, just its parameter count."""

    n_params: int
    arch: Architecture | None = None

    @classmethod
    def of(cls, arch: Architecture, head: str) -> ModelSpec:
        return cls(arch.params(head), arch)


@dataclass(frozen=True)
class Setup:
    """Everything a plan depends on. Batch sizes are global (``batch``) or per GPU (``micro_batch``)."""

    actor: ModelSpec
    critic: ModelSpec
    reward: ModelSpec
    dtype: str = "bfloat16"
    batch: int = 64
    prompt_len: int = 512
    response_len: int = 512
    micro_batch: int = 1
    lora_rank: int = 0
    activation_checkpointing: bool = False
    gpus: int = 1
    nodes: int = 1
    strategy: str = "single"
    gpu_memory: int = 80 * GiB
    forward_cache: bool = True  # training/scoring forwards keep a KV cache (transformers' default)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        for name in (
            "batch",
            "prompt_len",
            "response_len",
            "micro_batch",
            "gpus",
            "nodes",
            "gpu_memory",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for role in ("actor", "critic", "reward"):
            if getattr(self, role).n_params < 1:
                raise ValueError(
                    f"{role} parameter count must be positive, got {getattr(self, role).n_params}"
                )
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be at least 0, got {self.lora_rank}")
        if self.lora_rank and not (self.actor.arch and self.critic.arch):
            raise ValueError(
                "--lora-rank needs the model shapes to count adapter parameters: pass --config "
                "(and --critic-config/--reward-config if you gave those as --*-params)"
            )
        if self.micro_batch > self.batch:
            raise ValueError(
                f"--micro-batch {self.micro_batch} is larger than --batch {self.batch}"
            )

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def rollout_batch_per_gpu(self) -> int:
        """B: the rollout batch is split over every GPU (data parallel), whatever the strategy."""
        return math.ceil(self.batch / self.world)

    @property
    def shards(self) -> int:
        """W: how many GPUs share one copy of weights, gradients and optimizer state."""
        return self.world if self.strategy in ("fsdp", "fsdp-offload") else 1

    @property
    def offload(self) -> bool:
        return self.strategy in ("offload", "fsdp-offload")


@dataclass
class Row:
    """One row of the budget table, in bytes on one GPU. ``None`` = not sized (no model shape given)."""

    role: str
    n_params: int
    trainable: int
    parameters: int
    optimizer: int
    gradients: int
    activations: int | None
    kv_cache: int | None
    note: str = ""

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.optimizer
            + self.gradients
            + (self.activations or 0)
            + (self.kv_cache or 0)
        )


@dataclass
class Plan:
    setup: Setup
    rows: dict[str, Row]
    static: int  # weights + optimizer state: resident all the time
    phases: dict[
        str, int | None
    ]  # transient bytes on top of ``static`` in each phase of a PPO step
    cpu_optimizer: int  # optimizer state held in CPU memory (offload), whole job
    notes: list[str] = field(default_factory=list)

    @property
    def sized(self) -> bool:
        """False when some model has no shape, so activations and the KV cache are not counted."""
        return all(v is not None for v in self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k] or 0)

    @property
    def peak(self) -> int:
        """Per-GPU peak: ``static`` plus the largest phase (phases never overlap in time)."""
        return self.static + max((v or 0) for v in self.phases.values())

    @property
    def all_at_once(self) -> int:
        """The usual accounting: every column of every row resident together (an upper bound)."""
        return sum(r.total for r in self.rows.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.setup.gpu_memory


def training_activation_bytes(arch: Architecture, setup: Setup, head: str) -> int:
    """Activations of one training micro-batch (m sequences of s tokens) at their peak.

    Without checkpointing the peak is the end of the forward / start of the backward, when every
    layer's saved tensors are alive together with the head's transients:

        layers      m * s * L * a              a = ``activation_bytes_per_token_layer``
        final norm  m * s * (3h * b [+ upcast])
        KV cache    m * s * 2 * L * kv * b     transformers' default ``use_cache=True`` makes every
                                               forward, training ones too, keep a copy of each layer's
                                               K and V until it returns (``--no-forward-cache``: 0)
        head ``lm`` m * V * (s + 2T) * 4       float32 logits at every position, the log-softmax over
                                               the T response positions (kept by autograd), and in
                                               backward its gradient: an upper bound on both moments
        head ``score``  m * s * 4              one value per token

    With activation checkpointing (Korthikanti §4.2, "full recomputation") each layer keeps only its
    input, m * s * L * h * b; backward recomputes one layer at a time, which happens after the head's
    transients are gone, so the peak is the stored inputs + final norm + max(head, one layer m * s * a).
    Transformers turns the cache off under checkpointing.
    """
    b = dtype_bytes(setup.dtype)
    m, s, T = setup.micro_batch, setup.prompt_len + setup.response_len, setup.response_len
    a = arch.activation_bytes_per_token_layer(b)
    final = m * s * arch.final_norm_bytes_per_token(b)
    out = m * arch.vocab_size * (s + 2 * T) * LOGIT_BYTES if head == "lm" else m * s * LOGIT_BYTES
    if setup.activation_checkpointing:
        return m * s * arch.num_layers * arch.hidden_size * b + final + max(out, m * s * a)
    cache = m * s * arch.kv_bytes_per_token(b) if setup.forward_cache else 0
    return m * s * arch.num_layers * a + final + cache + out


def forward_only_bytes(arch: Architecture, setup: Setup, head: str) -> int:
    """Peak of one no-grad scoring forward on a micro-batch (reference and actor log-probs, reward, values).

    Nothing is kept between layers, so the peak is the larger of one layer's working set,
    m * s * (2h + 3I) * b, and the end: the last hidden state and, for an LM head, float32 logits at
    every position plus the log-softmax over the response, m * (s * h * b + V * (s + T) * 4). With
    transformers' default ``use_cache=True`` the forward also keeps every layer's K and V until it
    returns: + m * s * 2 * L * kv * b.
    """
    b = dtype_bytes(setup.dtype)
    m, s, T = setup.micro_batch, setup.prompt_len + setup.response_len, setup.response_len
    working = m * s * arch.forward_working_bytes_per_token(b)
    end = m * s * arch.hidden_size * b
    end += m * arch.vocab_size * (s + T) * LOGIT_BYTES if head == "lm" else m * s * LOGIT_BYTES
    cache = m * s * arch.kv_bytes_per_token(b) if setup.forward_cache else 0
    return cache + max(working, end)


def rollout_bytes(arch: Architecture, setup: Setup) -> int:
    """Peak of generating T tokens for the B rollout sequences on one GPU, with the KV cache.

    The larger of the prefill — cache of the P prompt tokens + one layer's working set over them,
    B * P * (2 * L * kv * b + (2h + 3I) * b) — and the last decoding step: the full cache
    B * s * 2 * L * kv * b, plus the larger of one layer's K or V twice while transformers'
    ``DynamicCache`` grows it by concatenation (1/(2L) of the cache) and one layer of the prompt's
    cache while the lean decoder moves it into its full-length buffers (1/L of the prompt's cache,
    :meth:`proximal.rollout.decode.LeanDecoder.start`), plus float32 logits and probabilities of the
    last token, B * V * 8.
    """
    b = dtype_bytes(setup.dtype)
    B, P, s = setup.rollout_batch_per_gpu, setup.prompt_len, setup.prompt_len + setup.response_len
    kv = arch.kv_bytes_per_token(b)
    prefill = B * P * (kv + arch.forward_working_bytes_per_token(b))
    full = B * s * kv
    growing = max(full // (2 * arch.num_layers), B * P * kv // arch.num_layers)
    decode = full + growing + B * arch.vocab_size * 2 * LOGIT_BYTES
    return max(prefill, decode)


def plan(setup: Setup) -> Plan:
    """Bytes on one GPU for each of the four models and each phase of one PPO step under ``setup``.

    Static (whole step): weights of all four models + the AdamW state of actor and critic, divided by
    W under FSDP; the optimizer state moves to CPU memory under offload.
    Phases (one at a time, each on top of static):
        rollout        actor KV cache for B sequences of s tokens (``rollout_bytes``)
        scoring        the largest no-grad forward of the four models on a micro-batch (on one device with
                       micro-batch = batch, plus the actor's activations: ``ppo.reuse_first_pass``)
        actor update   actor gradients + activations of one micro-batch (gradients of earlier
                       micro-batches are held while the next one runs: gradient accumulation)
        critic update  the same for the critic
    Under FSDP each phase also holds the all-gathered parameters of two units (the one computing and
    the one prefetched).
    """
    b = dtype_bytes(setup.dtype)
    w_b, g_b, o_b = _PER_PARAM[b]
    W, r = setup.shards, setup.lora_rank
    notes: list[str] = []

    def trainable_row(role: str, spec: ModelSpec, head: str) -> Row:
        if r:
            adapters = spec.arch.lora_params(r)
            trainable = adapters + (
                spec.arch.hidden_size if head == "score" else 0
            )  # the value head trains fully
            weights = spec.n_params * b + trainable * w_b
            note = f"LoRA r={r}: {_count(trainable)} trainable"
        else:
            trainable, weights, note = spec.n_params, spec.n_params * w_b, ""
        act = training_activation_bytes(spec.arch, setup, head) if spec.arch else None
        return Row(
            role,
            spec.n_params,
            trainable,
            _div(weights, W),
            0 if setup.offload else _div(trainable * o_b, W),
            _div(trainable * g_b, W),
            act,
            None if role == "actor" else 0,
            note,
        )

    actor = trainable_row("actor", setup.actor, "lm")
    critic = trainable_row("critic", setup.critic, "score")
    s = setup.prompt_len + setup.response_len
    Bg = setup.rollout_batch_per_gpu
    if setup.actor.arch:
        actor.kv_cache = Bg * s * setup.actor.arch.kv_bytes_per_token(b)

    ref_fwd = forward_only_bytes(setup.actor.arch, setup, "lm") if setup.actor.arch else None
    if r:
        # The reference is the actor's base model with the adapters switched off: no second copy.
        reference = Row(
            "reference",
            setup.actor.n_params,
            0,
            0,
            0,
            0,
            ref_fwd,
            0,
            "shares the actor's base weights (adapters disabled)",
        )
    else:
        reference = Row(
            "reference",
            setup.actor.n_params,
            0,
            _div(setup.actor.n_params * b, W),
            0,
            0,
            ref_fwd,
            0,
        )
    rw = setup.reward
    reward = Row(
        "reward",
        rw.n_params,
        0,
        _div(rw.n_params * b, W),
        0,
        0,
        forward_only_bytes(rw.arch, setup, "score") if rw.arch else None,
        0,
    )
    rows = {"actor": actor, "critic": critic, "reference": reference, "reward": reward}

    static = sum(x.parameters + x.optimizer for x in rows.values())
    cpu_opt = (actor.trainable + critic.trainable) * o_b if setup.offload else 0

    gather = 0
    archs = [sp.arch for sp in (setup.actor, setup.critic, setup.reward)]
    if W > 1:
        if all(archs):
            gather = 2 * max(a.largest_unit_params() for a in archs) * b
        else:
            notes.append("FSDP all-gather buffers not counted (no model shape given)")

    phases: dict[str, int | None] = {}
    if all(archs):
        arch = setup.actor.arch
        phases["rollout"] = rollout_bytes(arch, setup) + gather
        phases["scoring"] = max(x.activations for x in (reference, reward)) + gather
        phases["scoring"] = max(
            phases["scoring"], forward_only_bytes(setup.critic.arch, setup, "score") + gather
        )
        if W == 1 and setup.micro_batch >= setup.batch:
            # ppo.reuse_first_pass (the default) with one micro-batch of the whole batch: the first epoch's
            # actor forward runs before the experience, so its activations are held while the others score
            # (counted whatever ppo.mini_batch_size is: an upper bound when the pass is not shared).
            phases["scoring"] += actor.activations
            notes.append(
                "scoring holds the actor's activations (ppo.reuse_first_pass with micro-batch = batch "
                "on one device)"
            )
        phases["actor update"] = actor.gradients + actor.activations + gather
        phases["critic update"] = critic.gradients + critic.activations + gather
    else:
        phases = {
            "rollout": None,
            "scoring": None,
            "actor update": actor.gradients,
            "critic update": critic.gradients,
        }
        notes.append(
            "activations and KV cache not sized: pass --config (a model directory or config.json) "
            "so the planner knows layers, hidden size, heads and vocabulary"
        )
    return Plan(setup, rows, static, phases, cpu_opt, notes)


def _div(nbytes: int, shards: int) -> int:
    return -(-nbytes // shards)  # ceil: the largest shard


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------------------
# Cheapest strategy that fits
# --------------------------------------------------------------------------------------------------


def candidate_layouts(gpus_per_node: int, max_gpus: int = 8192):
    """(gpus per node, nodes, strategy) from cheapest up: fewer GPUs first (1, 2, 4, then whole nodes);
    at equal GPUs no sharding, then FSDP, then CPU optimizer offload alone, then FSDP with offload
    (offloading AdamW to the CPU costs the most step time)."""
    worlds = [w for w in (1, 2, 4) if w < gpus_per_node] + list(
        range(gpus_per_node, max_gpus + 1, gpus_per_node)
    )
    for world in worlds:
        gpus, nodes = (
            (world, 1) if world <= gpus_per_node else (gpus_per_node, world // gpus_per_node)
        )
        for strategy in (
            ("single", "offload") if world == 1 else ("single", "fsdp", "offload", "fsdp-offload")
        ):
            yield gpus, nodes, strategy


def cheapest_fit(setup: Setup, max_gpus: int = 8192, offload: bool = True) -> Plan | None:
    """The first plan in ``candidate_layouts`` order whose per-GPU peak fits ``setup.gpu_memory``.

    Nodes are taken to have ``--gpus`` GPUs when that is more than one, else 8. ``offload=False``
    skips the strategies that keep AdamW state in CPU memory.
    """
    per_node = setup.gpus if setup.gpus > 1 else 8
    for gpus, nodes, strategy in candidate_layouts(per_node, max_gpus):
        if not offload and strategy.endswith("offload"):
            continue
        p = plan(replace(setup, strategy=strategy, gpus=gpus, nodes=nodes))
        if p.fits:
            return p
    return None


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------

COLUMNS = (
    ("parameters", "parameters"),
    ("optimizer", "optimizer state"),
    ("gradients", "gradients"),
    ("activations", "activations (training)"),
    ("kv_cache", "KV cache (rollout)"),
    ("total", "total"),
)


def fmt(nbytes: int | None, unit: str) -> str:
    if nbytes is None:
        return "not sized"
    v = nbytes / UNITS[unit]
    if v == 0:
        return f"0 {unit}"
    return f"{v:,.1f} {unit}" if v >= 10 else f"{v:,.3g} {unit}"


def _layout(setup: Setup) -> str:
    if setup.world == 1:
        where = "1 GPU"
    else:
        where = f"{setup.world} GPUs ({setup.nodes} node{'s' * (setup.nodes > 1)} x {setup.gpus})"
    what = {
        "single": "no sharding (each GPU holds whole models)",
        "fsdp": "FSDP full shard",
        "offload": "no sharding, AdamW state in CPU memory",
        "fsdp-offload": "FSDP full shard, AdamW state in CPU memory",
    }
    return f"{setup.strategy} on {where}: {what[setup.strategy]}"


def render(p: Plan, unit: str, best: Plan | None, best_on_gpu: Plan | None = None) -> str:
    st = p.setup
    s = st.prompt_len + st.response_len

    def desc(role: str, spec: ModelSpec) -> str:
        return f"  {role:<9} {_count(spec.n_params)} params" + (
            f" ({spec.arch.model_type}, {spec.arch.source})" if spec.arch else ""
        )

    lines = [
        "proximal memory: the memory budget of PPO's four models (weights, AdamW states, gradients, "
        "activations), bytes on one GPU",
        desc("actor", st.actor),
        desc("critic", st.critic),
        desc("reference", st.actor),
        desc("reward", st.reward),
        f"  dtype {st.dtype}; rollout batch {st.batch} ({st.rollout_batch_per_gpu} per GPU), micro-batch "
        f"{st.micro_batch} per GPU, {st.prompt_len} prompt + {st.response_len} response = {s} tokens"
        + (f"; LoRA rank {st.lora_rank}" if st.lora_rank else "")
        + ("; activation checkpointing" if st.activation_checkpointing else ""),
        f"  strategy {_layout(st)}",
        "",
    ]
    table = [["model"] + [c for _, c in COLUMNS]]
    for role in ROLES:
        r = p.rows[role]
        table.append([role] + [fmt(getattr(r, k), unit) for k, _ in COLUMNS])
    sums = [[getattr(r, k) for r in p.rows.values()] for k, _ in COLUMNS]
    table.append(["all at once"] + [fmt(None if None in col else sum(col), unit) for col in sums])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for j, row in enumerate(table):
        lines.append(
            "  ".join(
                c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)
            )
        )
        if j == 0 or j == len(table) - 2:
            lines.append("  ".join("-" * wd for wd in widths))
    for role in ROLES:
        if p.rows[role].note:
            lines.append(f"  {role}: {p.rows[role].note}")
    lines.append("")
    phase_txt = ", ".join(f"{k} {fmt(v, unit)}" for k, v in p.phases.items())
    at_least = "" if p.sized else "at least "
    lines += [
        f"peak per GPU: {at_least}{fmt(p.peak, unit)} = weights + optimizer state {fmt(p.static, unit)}"
        f" + the largest phase, {p.peak_phase} ({phase_txt})"
    ]
    if p.cpu_optimizer:
        lines.append(
            f"CPU memory for the offloaded AdamW state: {fmt(p.cpu_optimizer, unit)} in all"
            f" ({fmt(-(-p.cpu_optimizer // st.nodes), unit)} per node)"
        )
    budget = fmt(st.gpu_memory, unit)
    if p.fits:
        verdict = f"verdict: FITS in {budget} per GPU ({100 * p.peak / st.gpu_memory:.0f}% used)"
        if not p.sized:
            verdict = (
                f"verdict: weights, optimizer and gradients fit in {budget}, but activations and "
                "the KV cache are not sized"
            )
    else:
        verdict = f"verdict: DOES NOT FIT in {budget} per GPU (needs {at_least}{p.peak / st.gpu_memory:.1f}x)"
    lines.append(verdict)
    if best is None:
        hint = "reduce --micro-batch or the sequence length" + (
            "" if st.activation_checkpointing else ", or add --activation-checkpointing"
        )
        lines.append(
            f"cheapest strategy that fits: none up to 8192 GPUs; {hint} (activations of one micro-batch "
            "do not shrink with more GPUs)"
        )
    else:
        unsized = "" if best.sized else " (activations and KV cache not counted)"
        cpu = (
            f"; AdamW state takes {fmt(-(-best.cpu_optimizer // best.setup.nodes), unit)} of CPU memory per node"
            if best.cpu_optimizer
            else ""
        )
        lines.append(
            f"cheapest strategy that fits: {_layout(best.setup)}, {fmt(best.peak, unit)} per GPU{unsized}{cpu}"
        )
        if best.setup.offload and best_on_gpu is not None:
            lines.append(
                f"cheapest without CPU offload: {_layout(best_on_gpu.setup)}, "
                f"{fmt(best_on_gpu.peak, unit)} per GPU{unsized}"
            )
    lines += [f"note: {n}" for n in p.notes]
    lines.append(
        "not counted: CUDA context and kernels (~0.5-1 GiB), allocator fragmentation and cache, "
        "communication buffers, temporaries inside kernels and AdamW's step (docs/memory.md)"
    )
    return "\n".join(lines)


def to_json(p: Plan, best: Plan | None, best_on_gpu: Plan | None = None) -> dict:
    def layout(x: Plan) -> dict:
        return {
            "strategy": x.setup.strategy,
            "gpus_per_node": x.setup.gpus,
            "nodes": x.setup.nodes,
            "world_size": x.setup.world,
            "peak_bytes_per_gpu": x.peak,
        }

    setup = asdict(p.setup)
    return {
        "setup": setup,
        "bytes_per_gpu": {
            role: {
                **{k: getattr(r, k) for k, _ in COLUMNS},
                "n_params": r.n_params,
                "trainable_params": r.trainable,
                "note": r.note,
            }
            for role, r in p.rows.items()
        },
        "all_at_once_bytes": p.all_at_once,
        "static_bytes": p.static,
        "phase_bytes": p.phases,
        "peak_phase": p.peak_phase,
        "peak_bytes_per_gpu": p.peak,
        "activations_sized": p.sized,
        "cpu_optimizer_bytes": p.cpu_optimizer,
        "gpu_memory_bytes": p.setup.gpu_memory,
        "fits": p.fits,
        "cheapest_fit": layout(best) if best else None,
        "cheapest_fit_without_offload": layout(best_on_gpu) if best_on_gpu else None,
        "notes": p.notes,
    }


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _count_arg(text: str) -> int:
    """70e9, 70000000000, 70B, 7.5b, 350M."""
    t = text.strip().lower().replace("_", "")
    try:
        v = float(t[:-1]) * _SUFFIX[t[-1]] if t and t[-1] in _SUFFIX else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count (e.g. 70e9, 7B, 350M)"
        ) from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a parameter count must be positive")
    return int(round(v))


def _int_arg(minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be at least {minimum}")
        return v

    return parse


def _gib_arg(text: str) -> int:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU memory must be positive")
    return int(v * GiB)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="proximal memory",
        description="Will PPO's four models (actor, critic, reference, reward) fit? The memory budget of "
        "their weights, AdamW states, gradients and activations per model and per GPU, "
        "with a verdict and the cheapest strategy that fits. "
        "Formulas and their derivation: docs/memory.md.",
        epilog="examples:\n  proximal memory --params 70e9\n"
        "  proximal memory --config ./my-llama --batch 128 --micro-batch 2 --activation-checkpointing "
        "--strategy fsdp --gpus 8 --nodes 4\n"
        "  proximal memory --config ./policy --reward-config ./rm --lora-rank 16 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = ap.add_argument_group(
        "models (the reference is a copy of the actor; with LoRA, the actor's base)"
    )
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--params",
        type=_count_arg,
        metavar="N",
        help="actor parameter count, e.g. 70e9 or 7B "
        "(sizes weights, gradients and optimizer state only)",
    )
    src.add_argument(
        "--config",
        "--model",
        dest="config",
        metavar="PATH",
        help="actor model directory or its config.json (read locally, never downloaded); "
        "sizes parameters, activations and KV cache",
    )
    for role, default in (
        ("critic", "the reward model's, which proximal ppo initialises it from"),
        ("reward", "the actor's backbone with a scalar head"),
    ):
        g = m.add_mutually_exclusive_group()
        g.add_argument(
            f"--{role}-params",
            type=_count_arg,
            metavar="N",
            help=f"{role} parameter count (default: {default})",
        )
        g.add_argument(
            f"--{role}-config",
            metavar="PATH",
            help=f"{role} model directory or config.json (default: {default})",
        )
    ap.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="weights/gradients/activations dtype; 16-bit = mixed precision with float32 AdamW "
        "master copy (2N + 2N + 12N), float32 = 4N + 4N + 8N (default: bfloat16)",
    )
    ap.add_argument(
        "--batch",
        type=_int_arg(1),
        default=64,
        help="rollout batch: prompts per PPO step, all GPUs (default: 64)",
    )
    ap.add_argument(
        "--prompt-len", type=_int_arg(1), default=512, help="prompt tokens P (default: 512)"
    )
    ap.add_argument(
        "--response-len", type=_int_arg(1), default=512, help="response tokens T (default: 512)"
    )
    ap.add_argument(
        "--micro-batch",
        type=_int_arg(1),
        default=1,
        help="sequences per forward/backward on one GPU (default: 1)",
    )
    ap.add_argument(
        "--lora-rank",
        type=_int_arg(0),
        default=0,
        help="LoRA rank on every linear layer of actor and critic; 0 = full fine-tuning (default: 0)",
    )
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="keep only each layer's input and recompute the layer in backward",
    )
    ap.add_argument(
        "--no-forward-cache",
        dest="forward_cache",
        action="store_false",
        help="the trainer passes use_cache=False to its training and scoring forwards; by default "
        "transformers keeps every layer's K and V during any forward, and this is counted",
    )
    ap.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="single",
        help="single: whole models on each GPU; fsdp: full shard of weights, gradients and AdamW "
        "state over gpus*nodes; offload / fsdp-offload: AdamW state in CPU memory (default: single)",
    )
    ap.add_argument("--gpus", type=_int_arg(1), default=1, help="GPUs per node (default: 1)")
    ap.add_argument("--nodes", type=_int_arg(1), default=1, help="nodes (default: 1)")
    ap.add_argument(
        "--gpu-memory",
        type=_gib_arg,
        default=80 * GiB,
        metavar="GIB",
        help="memory of one GPU in GiB (default: 80)",
    )
    ap.add_argument(
        "--units", choices=tuple(UNITS), default="GiB", help="units of the table (default: GiB)"
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON (always in bytes)")
    return ap


def setup_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Setup:
    """Turn parsed flags into a ``Setup``; every problem is a ``parser.error`` naming the flag."""

    def arch_of(flag: str, path: str | None) -> Architecture | None:
        if path is None:
            return None
        try:
            return load_architecture(path)
        except ConfigReadError as e:
            parser.error(f"{flag} {e}")

    actor_arch = arch_of("--config", args.config)
    actor = ModelSpec.of(actor_arch, "lm") if actor_arch else ModelSpec(args.params)
    reward_arch = arch_of("--reward-config", args.reward_config)
    if reward_arch:
        reward = ModelSpec.of(reward_arch, "score")
    elif args.reward_params:
        reward = ModelSpec(args.reward_params)
    else:  # the reward model has the actor's backbone with a scalar head instead of the LM head
        reward = ModelSpec.of(actor_arch, "score") if actor_arch else ModelSpec(actor.n_params)
    critic_arch = arch_of("--critic-config", args.critic_config)
    if critic_arch:
        critic = ModelSpec.of(critic_arch, "score")
    elif args.critic_params:
        critic = ModelSpec(args.critic_params)
    else:
        critic = reward  # as proximal ppo (and Ouyang et al. 2022): the critic starts from the reward model
    if args.strategy in ("fsdp", "fsdp-offload") and args.gpus * args.nodes == 1:
        parser.error(
            f"--strategy {args.strategy} shards over --gpus x --nodes GPUs; with 1 GPU use single or offload"
        )
    try:
        return Setup(
            actor=actor,
            critic=critic,
            reward=reward,
            dtype=args.dtype,
            batch=args.batch,
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            micro_batch=args.micro_batch,
            lora_rank=args.lora_rank,
            activation_checkpointing=args.activation_checkpointing,
            gpus=args.gpus,
            nodes=args.nodes,
            strategy=args.strategy,
            gpu_memory=args.gpu_memory,
            forward_cache=args.forward_cache,
        )
    except ValueError as e:
        parser.error(str(e))


def cli(argv: list[str]) -> int:
    """``proximal memory``: print the plan (or ``--json``); exit 0 whether or not it fits."""
    parser = build_parser()
    args = parser.parse_args(argv)
    setup = setup_from_args(args, parser)
    p = plan(setup)
    best, best_on_gpu = cheapest_fit(setup), cheapest_fit(setup, offload=False)
    if args.json:
        print(json.dumps(to_json(p, best, best_on_gpu), indent=2))
    else:
        print(render(p, args.units, best, best_on_gpu))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli(sys.argv[1:]))
