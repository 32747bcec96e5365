"""The loop of the methods that pass over a fixed data set — SFT, the reward model, DPO and SimPO.

Around each method's own per-micro-batch step and metrics, the rest is the same for all of them:
the data files and the run's step count, the sampler, resume, the step-0 row, then for every step:
accumulate the micro-batches of this rank's share of the global batch → refuse a non-finite loss →
clip and step → log → evaluate when due → checkpoint when due; at the end the trained model is
exported next to ``config.yaml``. A trainer calls, in order::

    run = open_run(...)                       # before any model loads
    data = load_data(load, ...)               # the rows (data errors surface now) and the step count
    ... build the model(s) ...
    optimizer, scheduler = optimizer_and_scheduler(model, ...)   # before any forward pass
    return fit(run, cfg, data, model=..., micro_step=..., metrics=..., held_out=..., ...)

The optimiser is the trainer's to build, before the model's first forward pass (DPO's precomputed
reference log-probabilities are one): under FSDP2 the root module keeps its gathered parameters
after a forward (it does not reshard, expecting a backward), and an optimiser built then would hold
those instead of the shards (found by a two-process DPO run whose checkpoint could not map them).

A method's ``micro_step`` gets the indices (into ``data.train``) of one micro-batch and the
normaliser — the global batch's units (rows, pairs or tokens: what its loss is a mean over) ÷ the
ranks — and returns sums; :func:`proximal.train.batches.accumulate` adds them over micro-batches
and ranks, so every number logged is global. With ``train.micro_batch_tokens`` the micro-batches are
cut by tokens (:func:`proximal.data.packing.plan_micro_batches`, from the method's ``lengths``)
instead of ``train.micro_batch_size`` rows; the normaliser is the same global one, so the step's
loss stays the mean over the whole batch however it is cut.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from proximal import dist
from proximal.config import ConfigError
from proximal.data.packing import plan_micro_batches, split_to
from proximal.data.sampler import Sampler
from proximal.data.sft import LoadReport
from proximal.data.sources import same_rows, same_rows_note
from proximal.models.flops import Tokens, forward_flops, train_flops
from proximal.train.batches import Sums, accumulate, plan_steps
from proximal.train.checkpoint import export_final
from proximal.train.optim import at_step, clip_and_step
from proximal.train.run import Run, check_per_rank, due
from proximal.train.sections import BatchTrainSection, OutputSection


def batch_split_problems(batch_size: int, micro_batch_size: int) -> list[str]:
    """Whether ``train.batch_size`` splits evenly over the processes, and each share into
    ``train.micro_batch_size`` passes (the rest of a fixed-data-set config's ``validate()`` after
    :func:`proximal.config.section_problems`; sizes below 1 are the section's own message)."""
    e: list[str] = []
    if batch_size >= 1 and micro_batch_size >= 1:
        check_per_rank(
            e, "train.batch_size", batch_size, "train.micro_batch_size", micro_batch_size
        )
    return e


@dataclass
class Data:
    """A fixed data set as loaded: the rows, what loading dropped, and the run's optimiser steps."""

    train: list
    eval: list  # empty: no held-out evaluation
    train_report: LoadReport
    eval_report: LoadReport | None
    total: int  # optimiser steps of the run


def load_data(
    load: Callable[[str, str | None], tuple[list, LoadReport]],
    train_file: str,
    eval_file: str | None,
    *,
    split: str | None = None,
    eval_split: str | None = None,
    steps: int | None,
    epochs: int,
    batch_size: int,
    warmup_steps: int,
    run: Run | None = None,
) -> Data:
    """``load(path, split)`` of the training file at ``split`` and, when given, the held-out file at
    ``eval_split`` (null: ``split``); the run's step count (:func:`proximal.train.batches.plan_steps`).
    Bad data and a batch larger than the data raise here, before any model loads; so does ``run``'s
    :class:`~proximal.train.run.RunFinished` when ``--resume auto`` finds its checkpoint at that
    step count. ``run`` learns the step count (:meth:`~proximal.train.run.Run.plan`: "auto"
    compiling weighs its cost against it). Held-out rows that are the training rows themselves (the
    same file, directory split or object) are said in one line: the held-out metrics would measure
    training rows."""
    held_split = split if eval_split is None else eval_split
    train, train_report = load(train_file, split)
    held, eval_report = load(eval_file, held_split) if eval_file else ([], None)
    if eval_file and run is not None and run.is_main:
        if same_rows(train_file, split, eval_file, held_split):
            run.say(same_rows_note(eval_file, held_split))
    total = plan_steps(
        len(train),
        steps=steps,
        epochs=epochs,
        batch_size=batch_size,
        warmup_steps=warmup_steps,
        train_file=train_file,
    )
    if run is not None:
        run.plan(total)
    return Data(train, held, train_report, eval_report, total)


def fit(
    run: Run,
    cfg,
    data: Data,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    max_grad_norm: float,
    name: str,
    tokenizer,
    train: BatchTrainSection,
    output: OutputSection,
    micro_step: Callable[[list[int], float], dict],
    metrics: Callable[[Sums, float, float], dict],
    held_out: Callable[[], dict],
    postfix: dict[str, tuple[str, ...]],
    units: Callable[[list[int]], float] = len,
    lengths: Callable[[int], list[int]],
    first: dict | None = None,
    models: dict | None = None,
    forward_only: tuple[str, ...] = (),
    scored: Callable[[int], int] | None = None,
    sampled: Callable[[int], dict] | None = None,
) -> Path:
    """Train ``model`` on ``data`` for ``data.total`` steps (from the checkpoint's step when ``run``
    resumes one); export it into the run directory and return that.

    ``optimizer`` and ``scheduler`` are ``model``'s over ``data.total`` steps
    (:func:`proximal.train.optim.optimizer_and_scheduler`), built before its first forward pass; each
    step clips the gradient norm to ``max_grad_norm`` (``optim.max_grad_norm``; 0 = no clipping).
    ``cfg`` is the command's config, written to ``config.yaml``; ``train`` and ``output`` are its
    sections of those types. ``name`` is the model's in checkpoints, in ``models.json`` and in
    messages ("model", "policy"). The method's part:

    - ``micro_step(indices, normalizer)``: one micro-batch of ``data.train``, its loss (÷ ``normalizer``)
      back-propagated; returns sums, among them ``loss_sum``;
    - ``units(global batch indices)``: what the loss is a mean over (pairs: ``len``; tokens);
    - ``lengths(index)``: the sequence lengths of row ``index`` of ``data.train`` (one for SFT, two
      for a pair), real tokens: to count each step's FLOPs and to cut micro-batches by
      ``train.micro_batch_tokens``;
    - ``metrics(sums, units, seconds)``: the step's own ``train/`` metrics, from the global sums, the
      batch's units and the step's seconds; grad norm, rate, epoch and wall time are added here;
    - ``held_out()``: the held-out metrics, at step 0, every ``train.eval_every`` steps and after
      the last (only when ``data.eval`` has rows);
    - ``postfix``: the progress bar's entries, each the first of its metric names in the row;
    - ``first``: the method's own step-0 entries, after the data counts and the step count;
    - ``models``: what ``models.json`` records (default: ``{name: model}``);
    - ``forward_only``: the names, among ``models``, of those that run a forward pass without
      gradients over every step's sequences (DPO's resident reference);
    - ``scored(index)``: how many positions of row ``index`` the language-model head scores (the
      tokens whose log-probabilities the loss reads; None: no language-model head, a reward model);
    - ``sampled(step)``: the sampled held-out metrics of the command's ``eval`` section
      (:class:`proximal.evaluation.TrainingEval`), ``{}`` at the steps it is not due.

    ``output.keep_best`` (an ``eval/*`` metric of ``held_out`` or ``sampled``) checkpoints every new
    best at its step and keeps it beside the newest ``train.keep_checkpoints``.

    Each step's ``perf/`` metrics count ``model``'s training pass and those forward passes over the
    batch's sequences (``lengths``, ``scored``), against the peak the run measured
    (docs/performance.md).
    """
    sampler = Sampler(
        len(data.train),
        train.batch_size,
        seed=train.seed,
        drop_last=True,
        rank=run.rank,
        world_size=run.world_size,
    )
    trained, stateful = {name: (model, optimizer)}, {"scheduler": scheduler, "sampler": sampler}
    if output.keep_best is not None and not data.eval and sampled is None:
        raise ConfigError(
            f"output.keep_best = {output.keep_best!r} needs held-out metrics: give data.eval_file"
        )
    start, counters = run.restore(trained, stateful)
    run.track_best(output.keep_best, output.keep_best_mode)
    run.begin(
        cfg,
        start=start,
        total=data.total,
        counters=counters,
        progress=output.progress,
        tensorboard=output.tensorboard,
        wandb_project=output.wandb_project,
        precision=train.precision,
    )
    run.record_models(**(models if models is not None else {name: model}))

    # Step 0: data counts and the held-out metrics before any update.
    if start == 0:
        row = {
            **data.train_report.metrics("train"),
            **(data.eval_report.metrics("eval") if data.eval_report else {}),
            "train/total_steps": data.total,
            **(first or {}),
        }
        run.log(0, {**row, **(held_out() if data.eval else {}), **(sampled(0) if sampled else {})})

    # Each optimiser step accumulates this rank's micro-batches of the global batch; every loss is
    # normalised by the global batch's units ÷ the ranks, so the gradient is the batch mean's.
    for step in range(start + 1, data.total + 1):
        t0 = time.perf_counter()
        batch = sampler.next_global_batch()
        n = units(batch)
        s = accumulate(
            micro_batches(sampler.local_part(batch), train, lengths, run.world_size, run.device),
            1,  # micro-batches already cut: each comes as a list of one
            lambda one: micro_step(one[0], n / run.world_size),
            run.device,
        )
        if not math.isfinite(s["loss_sum"]):
            optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"step {step}: the {run.command.upper()} loss is {s['loss_sum'] / n}; "
                "the step was not applied (lower optim.lr, or check the data)"
            )
        lr = scheduler.get_last_lr()[0]  # the rate this step runs at
        with at_step(step):
            grad_norm = clip_and_step(model, optimizer, scheduler, max_grad_norm, what=name)
        seconds = time.perf_counter() - t0
        seqs = [length for i in batch for length in lengths(i)]  # the global batch's sequences
        tokens = Tokens.of(seqs, head=sum(map(scored, batch)) if scored is not None else 0)
        flops = train_flops(run.shapes[name], tokens) + sum(
            forward_flops(run.shapes[m], tokens) for m in forward_only
        )
        row = {
            **metrics(s, n, seconds),
            **run.utilisation(seconds, flops=flops, tokens=tokens.body),
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/epoch": step / sampler.steps_per_epoch,
            "time/wall_s": run.wall_s(),
        }
        if data.eval and due(step, data.total, train.eval_every):
            row.update(held_out())
        row.update(sampled(step) if sampled is not None else {})
        shown = {label: next(row[m] for m in keys if m in row) for label, keys in postfix.items()}
        run.log(step, row, postfix=shown)
        if step == data.total:
            # The trained model (safetensors + tokenizer; with LoRA its adapters) next to
            # config.yaml, before the last checkpoint: a run whose last checkpoint exists has its
            # model (--resume auto then leaves it alone).
            export_final(run.dir, model, tokenizer)
        # A stop signal (SIGTERM, SIGUSR1, SIGINT) on any rank: this step's checkpoint, then the end.
        stop = run.stop_requested()
        if stop or due(step, data.total, train.save_every) or run.new_best(step):
            run.save(
                step,
                trained=trained,
                stateful=stateful,
                counters=counters,
                exports={name: (model, tokenizer)},
                keep=train.keep_checkpoints,
            )
        if stop:
            run.stop(step)

    if start == data.total:  # --resume of a finished run: its model written again
        export_final(run.dir, model, tokenizer)
    run.finish()
    return run.dir


def micro_batches(
    local: list[int],
    train: BatchTrainSection,
    lengths: Callable[[int], list[int]] | None,
    world_size: int,
    device: torch.device | str,
) -> list[list[int]]:
    """This rank's rows ``local`` cut into micro-batches (lists of indices): ``train.micro_batch_size``
    rows each, or with ``train.micro_batch_tokens`` by tokens (every rank then cuts the same number,
    the most any rank needs: a sharded model's forward passes are collective)."""
    if train.micro_batch_tokens is None:
        k = train.micro_batch_size
        return [local[i : i + k] for i in range(0, len(local), k)]
    groups = plan_micro_batches(
        [lengths(i) for i in local], train.micro_batch_tokens, packed=train.packing
    )
    if world_size > 1:
        count = dist.all_reduce_max(torch.tensor([float(len(groups))], device=device))
        groups = split_to(groups, int(count.item()))
    return [[local[j] for j in g] for g in groups]
