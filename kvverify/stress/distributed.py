"""Every GPU of a host (or of several hosts) in one stress run, through torch.distributed.

``torchrun --nproc-per-node N -m kvverify stress ...`` starts N processes (ranks); each drives
the GPU of its ``LOCAL_RANK``, runs its share of the campaign's cells (every cell, or with
``--shard`` a part of them), and sends what it observed to rank 0, which writes the one report
(``torch.distributed.gather_object`` over gloo: Python objects, no GPU collective).
``kvverify stress --gpus N`` starts the same through torch.distributed's launcher
(``torch.distributed.run``). Several hosts: the same torchrun command on each, with
``--nnodes`` and a rendezvous endpoint (``docs/stress.md``). One process without torchrun is a
world of one rank, run exactly as before.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
from collections.abc import Mapping, Sequence

from kvverify.geometry import KVLayout
from kvverify.stress.campaign import Campaign
from kvverify.stress.planning import PlannedCell, estimate

# How long rank 0 waits for the others to join and to send their results. torchrun's agent
# stops every rank when one dies, so this bounds only a rank that is alive and stuck; a rank's
# own run is bounded by --max-seconds and the executors' hold timeouts.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=24)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``world`` processes; ``local_rank``: its
    index on this host, i.e. the CUDA device it drives."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        """Rank 0: plans aloud, gathers, prints and writes the report."""
        return self.rank == 0


def from_env(environ: Mapping[str, str] = os.environ) -> Ranks | None:
    """The ranks torchrun set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), or None outside
    torchrun. Raises ValueError naming the variable when one is set but malformed."""
    if "WORLD_SIZE" not in environ or "RANK" not in environ:
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        text = environ.get(name, "0")
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"environment variable {name}={text!r} is not an integer (set by torchrun)") from None
    ranks = Ranks(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
    if not (0 <= ranks.rank < ranks.world and ranks.local_rank >= 0):
        raise ValueError(f"RANK {ranks.rank} / WORLD_SIZE {ranks.world} / LOCAL_RANK {ranks.local_rank} "
                         "do not describe a rank of the world")
    return ranks


def join(ranks: Ranks) -> None:
    """Join the process group of ``ranks`` (gloo; address and port from torchrun's environment)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world, timeout=COLLECTIVE_TIMEOUT)


def leave() -> None:
    """Leave the process group ``join`` made."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def bind_device(ranks: Ranks) -> str | None:
    """Make the GPU of ``ranks.local_rank`` this process's current CUDA device. Returns None, or
    why this rank has no GPU of its own. Where torch sees no CUDA device, binds nothing (the
    caller has its own reason to give, or runs on a stand-in)."""
    import torch

    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if ranks.local_rank >= count:
        return (f"LOCAL_RANK {ranks.local_rank} has no CUDA device of its own (this host shows {count}); "
                f"start at most {count} processes per host")
    torch.cuda.set_device(ranks.local_rank)
    return None


def current_device():
    """The CUDA device this process drives (a ``torch.device``), or None where torch sees none."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def gather(obj, ranks: Ranks) -> list | None:
    """Every rank's ``obj`` on rank 0, in rank order (None on the other ranks). A world of one
    rank needs no process group."""
    if ranks.world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * ranks.world if ranks.leader else None
    dist.gather_object(obj, out, dst=0)
    return out


def shard(planned: Sequence[PlannedCell], campaign: Campaign, layout: KVLayout, world: int) -> list[list[PlannedCell]]:
    """``planned`` split into ``world`` shares of about equal estimated time (longest first, each
    to the least loaded rank; ``planning.estimate``), each in plan order. The same on every rank:
    it depends only on the plan."""
    cost = [(estimate([pc], campaign, layout).seconds, i) for i, pc in enumerate(planned)]
    load = [0.0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for seconds, i in sorted(cost, key=lambda c: (-c[0], c[1])):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += seconds
        shares[rank].append(i)
    return [[planned[i] for i in sorted(share)] for share in shares]


def host_name() -> str:
    return socket.gethostname()


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run ``kvverify`` with ``argv`` (a stress command line without ``--gpus``) on ``nproc``
    local ranks through ``torch.distributed.run`` (standalone rendezvous); return rank 0's exit
    status, or the first failing rank's when rank 0 succeeded."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    config = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc), "--module", "kvverify",
                                           *argv])
    try:
        run(config)
    except ChildFailedError as exc:
        failures = exc.failures
        first = failures.get(0) or failures[min(failures)]
        code = first.exitcode
        if code < 0:  # killed by a signal
            code = 128 - code
        print(f"kvverify stress: rank {first.local_rank} exited {first.exitcode}", file=sys.stderr)
        return code
    return 0
