"""The memory planner (``proximal memory``): will a run of any method fit, and where?

- :mod:`~proximal.memory.arch` — a model's shape, counted from the model built on the meta device;
- :mod:`~proximal.memory.budget` — the terms (weights, gradients, AdamW states, activations, logits,
  KV cache) per model and per phase of each method's step, as documented formulas;
- :mod:`~proximal.memory.search` — the cheapest layout that fits, the largest micro-batch that fits;
- :mod:`~proximal.memory.render` — the table and the JSON;
- :mod:`~proximal.memory.runconfig` — what ``--run`` reads of a run's config;
- :mod:`~proximal.memory.command` — the command line.

Only ``arch`` loads torch and transformers, inside the functions that build a model on the meta
device; the rest is integer arithmetic. ``docs/memory.md`` derives every term and records the
measured checks (``benchmarks/memory_check.py``, ``benchmarks/memory_methods.py``).
"""

from proximal.memory.arch import (
    Architecture,
    ConfigReadError,
    architecture_from_config,
    load_architecture,
    read_config,
)
from proximal.memory.budget import (
    DTYPES,
    METHODS,
    ROLES,
    GiB,
    ModelSpec,
    Plan,
    Row,
    Setup,
    forward_only_bytes,
    plan,
    rollout_bytes,
    training_activation_bytes,
)
from proximal.memory.command import cli
from proximal.memory.search import cheapest_fit, largest_micro_batch

__all__ = [
    "DTYPES",
    "GiB",
    "METHODS",
    "ROLES",
    "Architecture",
    "ConfigReadError",
    "ModelSpec",
    "Plan",
    "Row",
    "Setup",
    "architecture_from_config",
    "cheapest_fit",
    "cli",
    "forward_only_bytes",
    "largest_micro_batch",
    "load_architecture",
    "plan",
    "read_config",
    "rollout_bytes",
    "training_activation_bytes",
]
