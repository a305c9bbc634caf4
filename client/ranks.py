"""This process's part of each epoch: its rank and the world size, read when they are known.

Given to RemoteLoader, they are fixed. Left out, they are torch.distributed's, read at each
``len()`` and at each pass's first batch, not when the loader is made: Lightning, Accelerate
and many torchrun scripts create the process group after the loader, and a loader that read
it at construction would play every sample on every rank. Until a process group exists (or
when torch.distributed never is initialized) a loader counts as rank 0 of 1: ``Partition.known``
says whether that is still provisional.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """Which part of each epoch this process plays.

    ``known``: given to the loader, or read from an initialized process group; False while
    the loader assumes rank 0 of 1 for lack of one (a process group made later changes it).
    """

    rank: int
    world_size: int
    known: bool = True


class Ranks:
    """A loader's rank and world size: those given, the rest read from torch.distributed.

    Args:
        rank: This process's rank, or None for torch.distributed's (validated: ``options.py``).
        world_size: The number of ranks, or None for torch.distributed's.
    """

    def __init__(self, rank: int | None, world_size: int | None):
        self.rank, self.world_size = rank, world_size

    def current(self) -> Partition:
        """The partition now: the given values, the process group's for the rest, else 0 of 1."""
        rank, world_size = self.rank, self.world_size
        known = rank is not None and world_size is not None
        if not known:
            import torch.distributed as dist  # (here: the receiver process unpickles Partitions, and imports no torch)

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
                known = True
        rank = 0 if rank is None else rank
        world_size = 1 if world_size is None else world_size
        if rank >= world_size:
            source = "torch.distributed's" if known else "1, as torch.distributed is not initialized yet"
            raise ValueError(
                f"rank={rank} with world_size={world_size}: expected a rank in 0..{world_size - 1} (rank was "
                f"given to RemoteLoader, world_size is {source}); pass world_size too"
            )
        return Partition(rank, world_size, known)
