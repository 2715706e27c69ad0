"""Data-parallel training on CPU (gloo) with msprobe's PrecisionDebugger on every rank, the
gradients averaged by all_reduce as DistributedDataParallel does:

    python -m torch.distributed.run --nproc_per_node 2 examples/msprobe_ddp.py DUMP_DIR
        [--plant nan-on-rank1] [--steps 3] [--task statistics|tensor]

--plant nan-on-rank1 takes the log of rank 1's inputs in step 1 (nan where they are
negative): the all_reduce then carries the nan into every rank's gradients. --plant
lr-on-rank1 gives rank 1 a learning rate of its own (0.1001): from step 1 on, the replicas'
parameters differ.
`precision-tool ac -lt DUMP_DIR` names the rank and the call that made it (mindstudio-probe
needed: pip install -e .[msprobe])."""
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from msprobe.pytorch import PrecisionDebugger


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dump_dir")
    p.add_argument("--plant", choices=["nan-on-rank1", "lr-on-rank1"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--task", default="statistics", choices=["statistics", "tensor"])
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = args.dump_dir.rstrip("/") + ".json"
    if rank == 0:
        with open(config, "w") as f:
            json.dump({"task": args.task, "dump_path": args.dump_dir, "rank": [], "step": [],
                       "level": "L1", args.task: {"scope": [], "list": [],
                                                  "data_mode": ["all"],
                                                  "summary_mode": "statistics"}}, f)
    dist.barrier()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    lr = 0.1001 if args.plant == "lr-on-rank1" and rank == 1 else 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    debugger = PrecisionDebugger(config_path=config)
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randint(0, 4, (8,), generator=data)
        debugger.start(model)
        if args.plant == "nan-on-rank1" and rank == 1 and step == 1:
            x = x.log()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for p_ in model.parameters():
            dist.all_reduce(p_.grad)
            p_.grad /= world
        opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
