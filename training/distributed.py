"""Training on several processes or machines with PyTorch's own distributed engine.

    torchrun --nproc-per-node 2 -m edgespec train --target gemma3-270m --features F --out H

torchrun starts one process per rank and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; `World.from_env` joins them into one process group (`nccl` where CUDA is there,
`gloo` on CPUs). The head is wrapped in DistributedDataParallel, so every optimizer (Muon
included) sees the gradient all-reduced over the ranks. Nothing here is a distributed engine
of our own: the ranks only split each global batch and sum a few counters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from edgespec.errors import EdgespecError


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str = ""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        """Rank 0 writes checkpoints and shows progress."""
        return self.rank == 0

    @classmethod
    def from_env(cls, timeout_s: float = 600.0) -> "World":
        """The world torchrun describes in the environment (one process alone without it)."""
        try:
            size = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local = int(os.environ.get("LOCAL_RANK", str(rank)))
        except ValueError:
            raise EdgespecError("WORLD_SIZE, RANK and LOCAL_RANK must be integers "
                                "(start several ranks with torchrun)") from None
        if size <= 1:
            return cls()
        if not 0 <= rank < size:
            raise EdgespecError(f"RANK {rank} is outside WORLD_SIZE {size}")
        import torch.distributed as dist

        cuda = torch.cuda.is_available()
        backend = "nccl" if cuda else "gloo"
        device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            try:
                dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
            except Exception as e:  # noqa: BLE001 - torch raises several kinds here
                raise EdgespecError(f"rank {rank}: could not join the other {size - 1} ranks "
                                    f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        return cls(rank=rank, size=size, local_rank=local, backend=backend, device=device)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks (in place; returned)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module as DistributedDataParallel over the ranks (itself on one process)."""
        if self.size <= 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def lost_peer(world: World, e: Exception, step: int) -> EdgespecError:
    """The one-line error of a rank whose collective failed (another rank died or hung)."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return EdgespecError(f"rank {world.rank} of {world.size}: lost contact with another rank at "
                         f"step {step} ({first[:160]}); run the same command with --resume to "
                         "continue from the last checkpoint")
