"""examples/ddp_train.py with msprobe's PrecisionDebugger on every rank (its lines are the
only change a script needs to be dumped by msprobe):

    python -m torch.distributed.run --nproc_per_node 2 examples/msprobe_ddp.py DUMP_DIR
        [--plant nan-on-rank1|lr-on-rank1] [--steps 3] [--task statistics|tensor]

`precision-tool ac -lt DUMP_DIR` then names the rank and the call that made a nan, or the
replicas that drift apart (mindstudio-probe needed: pip install -e .[msprobe])."""
import argparse
import json
import os
import sys

import torch.distributed as dist
from msprobe.pytorch import PrecisionDebugger

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_train import arguments, train  # noqa: E402


def main():
    p = arguments(argparse.ArgumentParser())
    p.add_argument("dump_dir")
    p.add_argument("--task", default="statistics", choices=["statistics", "tensor"])
    args = p.parse_args()
    dist.init_process_group("gloo")
    config = args.dump_dir.rstrip("/") + ".json"
    if dist.get_rank() == 0:
        with open(config, "w") as f:
            json.dump({"task": args.task, "dump_path": args.dump_dir, "rank": [], "step": [],
                       "level": "L1", args.task: {"scope": [], "list": [],
                                                  "data_mode": ["all"],
                                                  "summary_mode": "statistics"}}, f)
    dist.barrier()
    train(args.steps, args.plant, PrecisionDebugger(config_path=config))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
