"""Rollouts sampled in a process of their own while the trainer trains: ``rollout.staleness`` k ≥ 1.

**The schedule.** Version v of the policy is its weights after v updates (version 0: the starting
policy). At staleness k the batch trained at step t is sampled by version t − 1 − k, the policy of
step t − k, so while the trainer trains step t the generator samples a later step's batch:

    step t's batch   ← version max(0, t − 1 − k)         (steps 1 … k + 1: version 0)
    after update t   → version t published; batch t + 1 + k requested of it

``exact`` (the default) holds that schedule to the letter: the request for batch t + 1 + k names
version t, and the generator takes exactly those weights, whatever else is ready. So a run is
deterministic, and a checkpoint of step t holds what continues it — the batches requested of the
versions before t, sampled (ids, μ and all; the generator finishes them first), and the request of
version t, which the checkpoint's weights sample again alike on resume. ``bounded`` lets the
generator take the newest version published when it starts a batch: staleness ≤ k, whatever is
ready — faster to catch up, not reproducible.

**The weights.** The generator holds a copy of the policy of its own and takes a version's weights
from a *source* of tensors in shared memory:

- one process, a plain policy (not sharded, not LoRA): the source is the policy's own parameters,
  moved to shared memory once (``share_memory``). Publishing a version copies nothing in the
  trainer: the generator copies the tensors it needs, in its own process, off the trainer's path.
  The only thing the trainer may then have to wait for is that copy — only an optimiser step
  writes the parameters, and an optimiser step-pre-hook holds it until the generator has the
  version a request needs (a lock keeps the two apart in ``bounded`` mode).
- a sharded (FSDP2) or LoRA policy: the source is a full, plain copy (LoRA merged) in shared memory
  that each rank writes when it publishes — one gather (as the synchronous engine's every rollout
  gathers) and one copy into the source, after each update.

Under torchrun every rank has its generator, which samples that rank's rows: each node's generators
take their weights from that node's ranks, through that node's shared memory.

**What can go wrong.** A generator that dies (a crash, the kernel's OOM killer, ``SIGKILL``) or gives
no batch and takes no weights for ``rollout.generator_timeout_s`` seconds (hung) is detected by the
trainer while it waits: :class:`GeneratorLost`, one line, and the run exits with the requeue status,
so ``--resume auto`` continues from the last checkpoint. An exception inside the generator (a
mistake of the run's own: its environment, its tokenizer) is :class:`GeneratorError` with the
generator's message: retrying would meet it again. The generator dies with its trainer (Linux's
parent-death signal) and ignores the stop signals a scheduler sends the whole job: the trainer
finishes the step, checkpoints — the generator still serving what the checkpoint needs — and ends it.

On CPU in one process the generator is pinned to ``rollout.generator_cores`` and the trainer to the
other cores (threads included; vLLM's OpenMP threads by ``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import queue as queue_module
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp
from torch.optim.optimizer import register_optimizer_step_pre_hook

from proximal import dist
from proximal.config import ConfigError
from proximal.models import kernels
from proximal.models.parallel import gathered, is_sharded
from proximal.rollout.collect import Drawn, Responses, Sampling
from proximal.rollout.engine import build_engine
from proximal.rollout.vllm import pushed_weights

#: Seconds between the trainer's checks that its generator is alive while it waits.
POLL_S = 0.5
#: Seconds the generator may take to start (import, build its model and engine) at least.
START_S = 600.0


class GeneratorLost(RuntimeError):
    """The generator process died or hung: the run ends with the requeue status (a fresh start of
    the generator, from the last checkpoint, is the cure)."""


class GeneratorError(RuntimeError):
    """An exception inside the generator, its message carried over: the run ends with exit 1."""


def staleness_of(step: int, version: int) -> int:
    """How many updates behind the trainer's policy a batch sampled by ``version`` is at ``step``."""
    return step - 1 - version


def scheduled_version(step: int, staleness: int, start: int = 0) -> int:
    """The version that samples ``step``'s batch at staleness k in a run that started (or resumed
    without batches in flight: a checkpoint of staleness 0, or of a run since extended) at
    ``start``: step − 1 − k, never older than ``start``, the oldest version the run has."""
    return max(start, step - 1 - staleness)


# ----------------------------------------------------------------------------------------------
# Pinning
# ----------------------------------------------------------------------------------------------


def split_cores(chosen: list[int] | None, *, device: str, world_size: int) -> tuple:
    """``(trainer cores, generator cores)``, or ``(None, None)`` for no pinning. ``chosen``:
    ``rollout.generator_cores`` (None: the upper half of this process's cores; []: no pinning).
    Pinning is for CPU runs in one process (under torchrun the launcher places the ranks)."""
    if device != "cpu" or world_size > 1 or not hasattr(os, "sched_getaffinity"):
        return None, None
    mine = sorted(os.sched_getaffinity(0))
    if chosen is not None and not chosen:
        return None, None
    if chosen is None:
        if len(mine) < 2:
            return None, None
        generator = mine[len(mine) // 2 :]
    else:
        generator = sorted(set(chosen))
    trainer = [c for c in mine if c not in generator] or mine
    return trainer, generator


def pin_process(cores: list[int], threads: int | None = None) -> tuple[list[int], int]:
    """Every thread of this process (those to come inherit it) onto ``cores``, and torch's thread
    count to ``threads`` (default: their number). Returns what it was, ``(cores, threads)``, for
    putting it back (:meth:`StaleRollouts.close` does, at the run's end)."""
    before = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cores)
    torch.set_num_threads(threads or len(cores))
    return before


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies (no orphan)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# ----------------------------------------------------------------------------------------------
# The generator process
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _main_not_imported():
    """While a process is spawned: the caller's ``__main__`` hidden from it. ``spawn`` re-imports the
    parent's main script in the child, and a script that calls ``train_grpo`` without an ``if
    __name__ == "__main__"`` guard would start a second run there. The generator needs nothing of
    it: what it runs is proximal's, and reward functions and environments are named by import path."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


@dataclass
class Spec:
    """What the generator process builds its engine from (sent once, pickled)."""

    model_class: type
    config: object
    dtype: torch.dtype
    autocast: torch.dtype | None
    pad_token_id: int
    tokenizer: object
    make_responder: Callable
    engine: str
    engine_kwargs: dict
    device: str
    cpu_matmul: str
    cores: list[int] | None
    threads: int
    mode: str
    parent: int = field(default_factory=os.getpid)


def _serve(spec: Spec, source: dict, requests, results, published, copied, lock) -> None:
    """The generator's main: build the engine over a private model, then answer each request
    ``(step, version, prompts, sampling)`` with ``("batch", step, version, responses, seconds)``,
    taking the version's weights from ``source`` first when it has other ones."""
    _die_with_parent()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)  # the trainer decides when this process ends
    if os.getppid() != spec.parent:  # the trainer died before the signal was armed
        return
    step = None
    try:
        if spec.cores:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, spec.cores)))
            pin_process(spec.cores)
        elif spec.threads:
            torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cpu":
            kernels.configure(spec.cpu_matmul)
        with _uninitialised():  # its weights come from the trainer's at the first request
            model = spec.model_class(spec.config)
        model = model.to(device=device, dtype=spec.dtype)
        model.eval().requires_grad_(False)
        if device.type == "cpu":
            kernels.use_onednn_linears(model)
        if spec.autocast is not None:
            model._proximal_autocast = spec.autocast
        targets = model.state_dict(keep_vars=False)
        missing = sorted(set(targets) - set(source))
        if missing:
            raise RuntimeError(f"the policy's weights lack {missing[:3]}")
        engine = build_engine(spec.engine, model, spec.pad_token_id, **spec.engine_kwargs)
        responder = spec.make_responder()
        responder.ready(spec.tokenizer, model)
        have = -1
        results.put(("ready",))
        while True:
            request = requests.get()
            if request is None:
                break
            step, version, prompts, sampling = request
            if (version if spec.mode == "exact" else published.value) != have:
                with lock:  # the trainer holds it while an update writes the weights
                    want = version if spec.mode == "exact" else published.value
                    if spec.mode == "exact" and published.value != want:
                        raise RuntimeError(
                            f"step {step} needs version {want} but the weights are version "
                            f"{published.value}"
                        )
                    with torch.no_grad():
                        for name, target in targets.items():
                            target.copy_(source[name])
                    have = want
                    copied.value = have
                engine.after_update()
            t0 = time.perf_counter()
            got = responder.respond(engine, spec.tokenizer, prompts, sampling, device=device)
            # by value: torch.multiprocessing would pass each tensor's memory by a file descriptor
            # the trainer fetches from this process, and a hung or dead one never gives it
            batch = pickle.dumps(_to_cpu(got), protocol=pickle.HIGHEST_PROTOCOL)
            results.put(("batch", step, have, batch, time.perf_counter() - t0))
        engine.close()
        responder.close()
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which ends the run
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        frame = f" ({os.path.basename(where.filename)}:{where.lineno})" if where else ""
        at = f" sampling step {step}'s batch" if step is not None else " starting"
        with contextlib.suppress(Exception):
            results.put(("error", f"{type(e).__name__}: {e}{frame}{at}"))
            results.close()
            results.join_thread()  # the message written before the process ends
        os._exit(1)


class _Process(mp.get_context("spawn").Process):
    """The generator's process. It ignores SIGTERM (a scheduler's stop is the trainer's to handle),
    so ``terminate`` — what multiprocessing does to a daemon child when the trainer exits — kills."""

    def terminate(self) -> None:
        self.kill()


def _model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2 shards a module by swapping its class for a subclass it makes
    (``FSDP<Name>``), which cannot be pickled; the generator builds the class it derives from."""
    return next(c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed"))


def _stop(process, requests, hook=None, unpin=None) -> None:
    """The generator asked to stop, and killed if it does not within 10 s; the weights' guard
    (``hook``) removed; the trainer's cores and threads put back (``unpin``)."""
    if hook is not None:
        hook.remove()
    if unpin is not None:
        pin_process(*unpin)
    with contextlib.suppress(Exception):
        if process.is_alive():
            requests.put(None)
            process.join(timeout=10)
    with contextlib.suppress(Exception):
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


def _uninitialised():
    """transformers' ``no_init_weights``: a model built without drawing its random weights (minutes
    on a CPU for a 7B model), since the trainer's overwrite them. Where this transformers has no
    such context, the weights are drawn and overwritten alike."""
    try:
        from transformers.initialization import no_init_weights  # lazy: only in the generator
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _to_cpu(got: Responses) -> Responses:
    """The responses with the rollout's tensors on the CPU (a queue carries CPU tensors)."""
    r = got.rollout
    fields = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(r).items()}
    got.rollout = type(r)(**fields)
    if isinstance(got.turn_rewards, torch.Tensor):
        got.turn_rewards = got.turn_rewards.cpu()
    return got


def _to(got: Responses, device: torch.device) -> Responses:
    if device.type == "cpu":
        return got
    r = got.rollout
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(r).items()}
    got.rollout = type(r)(**fields)
    if isinstance(got.turn_rewards, torch.Tensor):
        got.turn_rewards = got.turn_rewards.to(device)
    return got


# ----------------------------------------------------------------------------------------------
# The trainer's side
# ----------------------------------------------------------------------------------------------


@dataclass
class Pending:
    """A batch requested of the generator: its step, the version that samples it, its prompts
    and — once it came — the responses and the generator's seconds."""

    step: int
    version: int
    drawn: Drawn
    responses: Responses | None = None
    generate_s: float = 0.0


@dataclass
class Taken:
    """A step's batch as the trainer takes it: the prompts, the responses, the version that sampled
    them, the generator's seconds and the seconds the trainer waited for it."""

    drawn: Drawn
    responses: Responses
    version: int
    generate_s: float
    wait_s: float


class StaleRollouts:
    """``rollout.staleness`` k ≥ 1: the batches a generator process samples ahead of the trainer
    (module docstring). Stateful: a checkpoint holds the batches in flight
    (:meth:`state_dict`), a resume restores them before the generator starts (:meth:`start`).

    The trainer's part, per step t: :meth:`take` (step t's batch; waits for it), then after its
    update :meth:`published` (version t) and :meth:`request` (batch t + 1 + k)."""

    def __init__(self, staleness: int, mode: str, *, timeout_s: float):
        self.staleness, self.mode, self.timeout_s = staleness, mode, timeout_s
        self.pending: dict[int, Pending] = {}
        self.version = 0  # the newest version published
        self.process = None
        self._sent: set[int] = set()  # steps whose request the generator has
        self.unpin: tuple[list[int], int] | None = None  # the trainer's cores and threads before

    # --- starting ------------------------------------------------------------------------------

    def start(
        self,
        policy: torch.nn.Module,
        tokenizer,
        *,
        version: int,
        make_responder: Callable,
        engine: str,
        engine_kwargs: dict,
        device: torch.device,
        cores: list[int] | None,
        threads: int,
    ) -> None:
        """Start the generator over ``policy`` (at ``version``: the run's start step), and send it
        the requests restored from a checkpoint."""
        self.version = version
        self.policy = policy
        self.live = not is_sharded(policy) and not hasattr(policy, "get_base_model")
        with torch.no_grad():
            if (
                self.live
            ):  # the policy's own tensors, in shared memory: nothing is copied to publish
                policy.share_memory()
                self.source = dict(pushed_weights(policy))
            else:  # a plain, full copy the trainer writes at each version
                with gathered(policy):
                    self.source = {
                        name: t.detach().to("cpu", copy=True).share_memory_()
                        for name, t in pushed_weights(policy)
                    }
        plain = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        plain = getattr(plain, "module", plain)
        first = next(iter(self.source.values()))
        ctx = mp.get_context("spawn")
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.published_v, self.copied = ctx.Value("q", version), ctx.Value("q", -1)
        self.lock = ctx.Lock()
        spec = Spec(
            model_class=_model_class(plain),
            config=plain.config,
            dtype=first.dtype if first.is_floating_point() else torch.float32,
            autocast=getattr(policy, "_proximal_autocast", None),
            pad_token_id=tokenizer.pad_token_id,
            tokenizer=tokenizer,
            make_responder=make_responder,
            engine=engine,
            engine_kwargs=engine_kwargs,
            device=str(device),
            cpu_matmul=kernels.backend()[0] if device.type == "cpu" else "auto",
            cores=cores,
            threads=threads,
            mode=self.mode,
        )
        self.process = _Process(
            target=_serve,
            args=(spec, self.source, self.requests, self.results, self.published_v, self.copied),
            kwargs={"lock": self.lock},
            daemon=True,
            name="proximal-generator",
        )
        with _main_not_imported():
            self.process.start()
        self._hook, self._holding = None, False
        if self.live:
            self._params = {p.data_ptr() for p in policy.parameters()}
            me = weakref.ref(self)  # the global hook must not keep this object alive

            def before_step(optimizer, args, kwargs):
                if (live := me()) is not None:
                    live._before_step(optimizer, args, kwargs)

            self._hook = register_optimizer_step_pre_hook(before_step)
        # a run that fails between here and close() stops its generator when this object goes
        self._finalizer = weakref.finalize(
            self, _stop, self.process, self.requests, self._hook, self.unpin
        )
        self._wait_for(lambda m: m[0] == "ready", "start", max(self.timeout_s, START_S))
        for step in sorted(self.pending):
            if self.pending[step].responses is None:
                self._send(self.pending[step])

    # --- the trainer's calls -------------------------------------------------------------------

    def request(self, step: int, version: int, drawn: Drawn, sampling: Sampling) -> None:
        """Ask for ``step``'s batch of ``drawn``, sampled by ``version`` as ``sampling`` says."""
        p = Pending(step, version, drawn)
        p.sampling = sampling
        self.pending[step] = p
        self._send(p)

    def take(self, step: int, device: torch.device) -> Taken:
        """``step``'s batch; waits for the generator (GeneratorLost when it died or hung)."""
        t0 = time.perf_counter()
        p = self.pending.get(step)
        if p is None:
            raise RuntimeError(f"step {step}: no batch was requested of the generator")
        while p.responses is None:
            self._receive()
        del self.pending[step]
        self._sent.discard(step)
        return Taken(
            p.drawn,
            _to(p.responses, device),
            p.version,
            p.generate_s,
            time.perf_counter() - t0,
        )

    def published(self, version: int) -> None:
        """The policy's weights are ``version`` now (after update ``version``): a staged source
        takes them here (every rank: a sharded policy's gather is a collective)."""
        if not self.live:
            self._writing()
            self._acquire()
            try:
                with torch.no_grad(), gathered(self.policy):
                    for name, t in pushed_weights(self.policy):
                        self.source[name].copy_(t)
                self.published_v.value = version
            finally:
                self.lock.release()
        else:
            self.published_v.value = version
            if self._holding:  # the update's first optimiser step took the lock (_before_step)
                self._holding = False
                self.lock.release()
        self.version = version

    # --- the weights' guard --------------------------------------------------------------------

    def _needed(self) -> bool:
        """Whether a request still needs the weights as they are (the newest version) and the
        generator has not taken them yet."""
        if self.mode != "exact":
            return False
        return any(
            p.version == self.version and p.responses is None for p in self.pending.values()
        ) and (self.copied.value < self.version)

    def _writing(self) -> None:
        """Before the weights change: wait until the generator took the version a request needs."""
        start = time.monotonic()
        while self._needed():
            self._check(start, f"to take version {self.version} of the weights")
            self._receive(block=False)
            time.sleep(0.001)

    def _before_step(self, optimizer, args, kwargs) -> None:
        """An optimiser step of the policy is about to write its weights: once per update, wait
        until the generator took the version a request needs, then hold the lock until the update
        is published, so that the generator never copies weights halfway through an update."""
        if self._holding or self.process is None or not self._owns(optimizer):
            return
        self._writing()
        self._acquire()
        self._holding = True

    def _acquire(self) -> None:
        """The lock, which the generator holds while it copies weights: waited for as a batch is
        (a generator stopped or killed while holding it is hung or dead, not waited for forever)."""
        start = time.monotonic()
        while not self.lock.acquire(timeout=POLL_S):
            self._check(start, "for it to finish taking the weights")

    def _owns(self, optimizer) -> bool:
        return any(
            p.data_ptr() in self._params
            for group in optimizer.param_groups
            for p in group["params"]
        )

    # --- messages --------------------------------------------------------------------------------

    def _send(self, p: Pending) -> None:
        self.requests.put((p.step, p.version, p.drawn.prompts, p.sampling))
        self._sent.add(p.step)

    def _receive(self, block: bool = True) -> None:
        start = time.monotonic()
        while True:
            try:
                message = self.results.get(timeout=POLL_S if block else 0.0)
            except (ConnectionError, EOFError, OSError):  # a batch whose sender died mid-way
                self._check(start, "for a batch", 0.0)
                raise
            except queue_module.Empty:
                if not block:
                    return
                waiting = min(
                    (s for s, p in self.pending.items() if p.responses is None), default=None
                )
                self._check(start, f"for step {waiting}'s batch")
                continue
            self._handle(message)
            return

    def _wait_for(self, done: Callable, what: str, timeout_s: float) -> None:
        start = time.monotonic()
        while True:
            try:
                message = self.results.get(timeout=POLL_S)
            except queue_module.Empty:
                self._check(start, f"to {what}", timeout_s)
                continue
            if done(message):
                return
            self._handle(message)

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "error":
            self.close()
            raise GeneratorError(f"the rollout generator failed: {message[1]}")
        if kind == "batch":
            _, step, version, responses, seconds = message
            p = self.pending[step]
            p.responses, p.generate_s, p.version = pickle.loads(responses), seconds, version

    def _check(self, start: float, what: str, timeout_s: float | None = None) -> None:
        """GeneratorLost when the generator is dead, or has waited longer than the timeout."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self.process is None:
            raise RuntimeError("the rollout generator was not started")
        if not self.process.is_alive():
            code = self.process.exitcode
            try:  # its last word, when it had one
                message = self.results.get(timeout=POLL_S)
                if message[0] == "error":
                    self.close()
                    raise GeneratorError(f"the rollout generator failed: {message[1]}")
            except (queue_module.Empty, OSError, EOFError):
                pass
            how = (
                f"was killed by {signal.Signals(-code).name}"
                if code and code < 0
                else f"exited ({code})"
            )
            pid = self.process.pid
            self.close()
            raise GeneratorLost(
                f"the rollout generator (pid {pid}) {how} while the trainer waited "
                f"{what}: the run ends for a restart (--resume auto continues it)"
            )
        if time.monotonic() - start > timeout_s:
            pid = self.process.pid
            self.process.kill()  # hung: asking it to stop would wait in vain
            self.close()
            raise GeneratorLost(
                f"the rollout generator (pid {pid}) gave nothing for {timeout_s:g} s "
                f"(rollout.generator_timeout_s) while the trainer waited {what}: it is hung; the "
                "run ends for a restart (--resume auto continues it)"
            )

    # --- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The batches in flight, every rank's: those requested of earlier versions sampled first
        (waited for), those of the newest version as requests (its weights are the checkpoint's)."""
        for p in list(self.pending.values()):
            while p.version < self.version and p.responses is None:
                self._receive()
        mine = [
            dict(
                step=p.step,
                version=p.version,
                drawn=p.drawn,
                sampling=p.sampling,
                responses=p.responses if p.version < self.version else None,
                generate_s=p.generate_s,
            )
            for p in sorted(self.pending.values(), key=lambda p: p.step)
        ]
        return {
            "staleness": self.staleness,
            "mode": self.mode,
            "version": self.version,
            "ranks": dist.all_gather_object(mine),
        }

    def load_state_dict(self, state: dict) -> None:
        ranks = state["ranks"]
        if len(ranks) != dist.world_size():
            raise ConfigError(
                f"the checkpoint's rollouts in flight (rollout.staleness {state['staleness']}) were "
                f"sampled on {len(ranks)} processes; resume it on {len(ranks)}, not "
                f"{dist.world_size()}"
            )
        if state["staleness"] != self.staleness:
            raise ConfigError(
                f"the checkpoint was written at rollout.staleness {state['staleness']}: resume it "
                f"with the same (not {self.staleness})"
            )
        self.pending = {}
        for d in ranks[dist.rank()]:
            p = Pending(d["step"], d["version"], d["drawn"], d["responses"], d["generate_s"])
            p.sampling = d["sampling"]
            self.pending[p.step] = p

    def close(self) -> None:
        """Stop the generator (idempotent), remove the weights' guard and put the trainer's cores
        and threads back (the finaliser does the same if the run ends without calling this)."""
        if getattr(self, "_holding", False):
            self._holding = False
            with contextlib.suppress(ValueError):
                self.lock.release()
        process, self.process = self.process, None  # _check reports no generator stopped on purpose
        if process is None:
            return
        self._finalizer()  # _stop: the process, the hook, the cores
        self._hook = None
        for q in (self.requests, self.results):
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
                q.close()
