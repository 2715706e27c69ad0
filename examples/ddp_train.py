"""Data-parallel training on CPU (gloo), gradients averaged by all_reduce as
DistributedDataParallel does, with no tool in it:

    python -m torch.distributed.run --nproc_per_node 2 -m precision_tool torch-run \\
        --target npu --dump-step all -- examples/ddp_train.py [--plant nan-on-rank1]

dumps every rank's steps (a run per rank) for `precision-tool ac`. --plant nan-on-rank1 takes
the log of rank 1's inputs in step 1 (nan where they are negative): the all_reduce then
carries it into every rank's gradients. --plant lr-on-rank1 gives rank 1 a learning rate of
its own (0.1001): from step 1 on, the replicas' parameters differ. --plant
unnormalised-on-rank1 feeds rank 1 inputs 30000 times too large in step 1: in fp16 its first
layer saturates, and the all_reduce carries the difference to every rank."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PLANTS = ("nan-on-rank1", "lr-on-rank1", "unnormalised-on-rank1")


class _Nothing:
    def start(self, model=None):
        pass

    def stop(self):
        pass

    def step(self):
        pass


def train(steps: int = 3, plant=None, debugger=None) -> None:
    """The loop; debugger: one with start(model), stop() and step() around each step
    (msprobe's, in examples/msprobe_ddp.py)."""
    debugger = debugger or _Nothing()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    lr = 0.1001 if plant == "lr-on-rank1" and rank == 1 else 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randint(0, 4, (8,), generator=data)
        debugger.start(model)
        if plant == "nan-on-rank1" and rank == 1 and step == 1:
            x = x.log()
        if plant == "unnormalised-on-rank1" and rank == 1 and step == 1:
            x = x * 30000.0
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()


def arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--plant", choices=PLANTS)
    parser.add_argument("--steps", type=int, default=3)
    return parser


if __name__ == "__main__":
    args = arguments(argparse.ArgumentParser()).parse_args()
    dist.init_process_group("gloo")
    train(args.steps, args.plant)
    dist.destroy_process_group()
