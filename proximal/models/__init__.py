"""Models: loading Hugging Face checkpoints, the critic's scalar head, LoRA, tiny test models."""
