"""proximal: textbook-exact PPO-based RLHF."""

__version__ = "0.1.0"
