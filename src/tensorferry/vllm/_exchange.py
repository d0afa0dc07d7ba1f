"""Trainer side, several ranks: each round's tickets to rank 0, and rank 0's outcome back.

Ranks trade plain bytes (``Ticket.to_bytes()``, a few KB) over a gloo
group of their own, made at ``trainer_init`` (every rank calls it, as
``new_group`` requires): host tensors whatever the training group's
backend is (NCCL takes device tensors only), and nothing pickled.
"""

from __future__ import annotations

import torch

from ..errors import ConfigurationError

__all__ = ["TicketExchange"]


class TicketExchange:
    """Rank 0 collects every rank's bytes; everyone learns whether rank 0's round succeeded.

    Raises:
        ConfigurationError: ``torch.distributed`` is not initialised, or its
            world or rank is not the init info's.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigurationError(
                f"TensorferryTrainerInitInfo(world_size={world_size}): ranks trade tickets over torch.distributed, "
                "which is not initialised: call torch.distributed.init_process_group first (or set world_size=1)"
            )
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ConfigurationError(
                f"TensorferryTrainerInitInfo(rank={rank}, world_size={world_size}) differs from torch.distributed's "
                f"rank {dist.get_rank()} of {dist.get_world_size()}: pass rank=dist.get_rank() and "
                "world_size=dist.get_world_size() (the ranks of the WeightSource's meshes)"
            )
        self.rank, self.world_size = rank, world_size
        self.group = dist.new_group(backend="gloo")

    def gather(self, payload: bytes) -> list[bytes] | None:
        """Every rank's ``payload``, in rank order, on rank 0 (None elsewhere). A collective."""
        import torch.distributed as dist

        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        top = max(int(s) for s in sizes)
        mine = torch.zeros(top, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if self.rank != 0:
            dist.gather(mine, None, dst=0, group=self.group)
            return None
        parts = [torch.empty(top, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.gather(mine, parts, dst=0, group=self.group)
        return [part[: int(n)].numpy().tobytes() for part, n in zip(parts, sizes)]

    def agree(self, ok: bool) -> bool:
        """Rank 0's ``ok`` on every rank (rank 0 drove the round). A collective."""
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.broadcast(flag, src=0, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group(self.group)
