"""Datasets: prompts (PPO), prompt/response pairs (SFT), preference pairs (reward model)."""
