"""The pieces of the head-to-head benchmarks (``benchmarks/compare_trl.py``, ``scaling.py``,
``profile_step.py``): the works and their models, the anchors' virtual environments, measured child
processes, proximal's side, and the report. Run with proximal's own Python; the anchors' sides run
in their own environments (``benchmarks/trl_ppo_run.py``, ``trl_grpo_run.py``) and import nothing
from here.
"""
