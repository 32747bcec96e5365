"""``python -m proximal`` (and ``torchrun --nproc_per_node N -m proximal <command> ...``)."""

from proximal.cli import entry

entry()
