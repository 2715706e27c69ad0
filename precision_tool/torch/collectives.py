"""torch.distributed's collectives, seen while the debugger runs: a data-parallel script's
all_reduce is a call of the step like any other (Distributed.all_reduce.0.forward, msprobe's
name), whose input is the tensor as the rank had it and whose output what every rank got
back. The collectives run in the process group's own code, under no torch function a mode
sees, so the module's functions are wrapped while the debugger is started and restored when
it stops; a call that returns a work handle (async_op) is recorded when it returns, before
the result is in (its output then is what the tensor held)."""
from __future__ import annotations

import os
from typing import Callable, Dict

from ..dump.layout import ENV_RANK_GROUP, launch_group

# each collective -> which of its arguments it writes its result into (its outputs) and
# which it reads (its inputs), by position
COLLECTIVES = {
    "all_reduce": ((0,), (0,)), "broadcast": ((0,), (0,)), "reduce": ((0,), (0,)),
    "all_gather": ((0,), (1,)), "all_gather_into_tensor": ((0,), (1,)),
    "reduce_scatter": ((0,), (1,)), "reduce_scatter_tensor": ((0,), (1,)),
    "all_to_all_single": ((0,), (1,)),
}


def rank_info() -> Dict[str, object]:
    """This process's place in a distributed launch, for run.json: rank, world size and the
    group every rank of the launch shares (layout.launch_group; torch-run passes its own);
    {} outside one (no RANK in the environment)."""
    rank = os.environ.get("RANK")
    if rank is None or not rank.isdigit():
        return {}
    group = os.environ.get(ENV_RANK_GROUP) or launch_group()
    return {"rank": f"rank{rank}", "rank_number": int(rank),
            "world_size": int(os.environ.get("WORLD_SIZE", "0") or 0), "rank_group": group}


class CollectiveWatch:
    """Wraps the collectives of torch.distributed: on_call(api, inputs, call) where call()
    runs the collective and returns (its result, the tensors it wrote)."""

    def __init__(self, on_call: Callable):
        import torch.distributed as dist
        self.dist = dist
        self.saved: Dict[str, Callable] = {}
        for name, (outs, ins) in COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.saved[name] = original
            setattr(dist, name, self._wrap(name, original, outs, ins, on_call))

    @staticmethod
    def _wrap(name, original, outs, ins, on_call):
        def collective(*args, **kwargs):
            def tensors(positions):
                found = []
                for k in positions:
                    v = args[k] if k < len(args) else None
                    found.extend(v if isinstance(v, (list, tuple)) else [v])
                return [t for t in found if t is not None and hasattr(t, "dtype")]

            def call():
                return original(*args, **kwargs), tensors(outs)
            return on_call(f"Distributed.{name}", tensors(ins), call)
        collective.__wrapped__ = original
        return collective

    def remove(self) -> None:
        for name, original in self.saved.items():
            setattr(self.dist, name, original)
        self.saved = {}
