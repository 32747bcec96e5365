"""Agents: environments, tools and multi-turn token-in/token-out rollouts (docs/agents.md).

Nothing is imported here: :mod:`proximal.agents.worker` runs in the tool worker processes, which
must start without loading torch.
"""
