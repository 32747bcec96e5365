"""Which rows each step reads: one resumable sampler for every method, split disjointly over ranks.

A step's **global** batch is a slice of one permutation of the data set, the same on every rank
(it depends only on the seed, the pass and the position); rank r of W reads the r-th contiguous
part of it. So the union over ranks is exactly the batch one process would read, the parts are
disjoint, and a run gives the same batches whatever its number of processes. The state — the pass
(``epoch``) and the position in it — is two integers, saved in every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sampler:
    """Shuffled passes over ``n`` rows in global batches of ``batch_size``.

    ``drop_last``: a pass ends when fewer than ``batch_size`` rows remain (those are left out of the
    pass, as SFT and DPO usually do); otherwise a batch runs on into the next pass (prompt sets for
    the online methods, where a step needs a full batch however small the data set).
    Each pass's order is ``torch.randperm(n)`` under a generator seeded with ``seed + epoch``.
    """

    n: int
    batch_size: int
    seed: int
    shuffle: bool = True
    drop_last: bool = False
    rank: int = 0
    world_size: int = 1
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.n < 1:
            raise ValueError("Sampler: an empty data set")
        if self.batch_size < 1 or self.batch_size % self.world_size:
            raise ValueError(
                f"Sampler: batch_size {self.batch_size} must be a positive multiple of the "
                f"{self.world_size} processes"
            )
        if self.drop_last and self.batch_size > self.n:
            raise ValueError(
                f"Sampler: batch_size {self.batch_size} is larger than the {self.n} rows"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Full batches in one pass (with ``drop_last``)."""
        return self.n // self.batch_size

    def _perm(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next_global_batch(self) -> list[int]:
        """The step's global batch (every rank gets the same list)."""
        if not self._order:
            self._order = self._perm()
        out: list[int] = []
        while len(out) < self.batch_size:
            left = self.n - self.position
            if left == 0 or (self.drop_last and left < self.batch_size):
                self.epoch += 1
                self.position = 0
                self._order = self._perm()
                continue
            take = min(self.batch_size - len(out), left)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def local_part(self, global_batch: list) -> list:
        """This rank's contiguous share of a global batch (or of any list as long as it)."""
        per = len(global_batch) // self.world_size
        return global_batch[self.rank * per : (self.rank + 1) * per]

    def next_batch(self) -> list[int]:
        """This rank's rows of the next global batch."""
        return self.local_part(self.next_global_batch())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._perm()


def shard_for_eval(
    n: int, micro_batch_size: int, rank: int = 0, world_size: int = 1
) -> list[list[int]]:
    """This rank's micro-batches of row indices for a pass over ``n`` rows (evaluation).

    Rows are split into contiguous, disjoint parts, one per rank. Every rank gets the same number of
    micro-batches — a sharded model needs every rank in every forward — so a rank with fewer rows
    gets empty lists at the end; the caller runs a placeholder forward for those and counts nothing.
    """
    per = -(-n // world_size)
    mine = list(range(rank * per, min(n, (rank + 1) * per)))
    n_batches = max(1, -(-per // micro_batch_size))
    return [mine[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(n_batches)]
