"""Built-in tasks: offline, download-free, each with its data, a tokenizer, a tiny model and a score
apart from any learned reward model.

- ``digits`` (:mod:`proximal.tasks.digits`) — sort a string of digits, scored by a gold score; the
  demo (``proximal demo``) runs the whole of RLHF on it (docs/demo.md), and its held-out scores
  are :data:`proximal.tasks.digits.EVAL_SCORES`.
- ``arithmetic`` (:mod:`proximal.tasks.arithmetic`) — multi-step integer arithmetic with reference
  answers in an ``answer`` column, rewarded by a verifier (TRL's reward-function signature).
- ``calculator`` (:mod:`proximal.tasks.calculator`) — multiplying three-digit numbers with a
  ``calculator`` tool: multi-turn trajectories (docs/agents.md), rewarded by a verifier.

``proximal compare --compare.task`` runs the methods on any of them (docs/compare.md).
"""
