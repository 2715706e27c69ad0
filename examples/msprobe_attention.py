"""A small attention classifier trained for a few steps with msprobe's PrecisionDebugger on:
the debugger's lines are the only change a script needs to be dumped by msprobe.

    python examples/msprobe_attention.py DUMP_DIR [--task tensor|statistics|md5]
        [--level L1|mix|L0] [--steps N] [--plant unnormalised-inputs] [--bf16]

--plant unnormalised-inputs feeds the model its inputs unnormalised (times 2000): in fp16 the
attention scores overflow. --bf16 trains the model in bfloat16 as a device script would
(`.bfloat16()` on the model and the inputs, the logits `.float()` for the loss): its dump
holds cast calls a float32 baseline's does not. Run it as it is for a baseline, and under
`precision-tool torch-run --target npu` for the simulated NPU's dump (both need
mindstudio-probe: pip install -e .[msprobe])."""
import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from msprobe.pytorch import PrecisionDebugger


class Attention(nn.Module):
    def __init__(self, d=32, classes=4):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 8.0
        h = self.norm(torch.softmax(scores, -1) @ self.v(x) + x)
        return self.out(h).mean(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dump_dir")
    p.add_argument("--task", default="tensor", choices=["tensor", "statistics", "md5"])
    p.add_argument("--level", default="L1", choices=["L0", "L1", "mix"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--plant", choices=["unnormalised-inputs"])
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    task = "statistics" if args.task == "md5" else args.task
    config = {"task": task, "dump_path": args.dump_dir, "rank": [], "step": [],
              "level": args.level, "enable_dataloader": False,
              task: {"scope": [], "list": [], "data_mode": ["all"],
                     "summary_mode": "md5" if args.task == "md5" else "statistics"}}
    os.makedirs(args.dump_dir, exist_ok=True)
    config_path = os.path.join(args.dump_dir, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)

    torch.manual_seed(0)
    model = Attention().bfloat16() if args.bf16 else Attention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    debugger = PrecisionDebugger(config_path=config_path)
    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(8, 16, 32, generator=data) * (2000.0 if args.plant else 4.0)
        y = torch.randint(0, 4, (8,), generator=data)
        debugger.start(model)
        logits = model(x.bfloat16()).float() if args.bf16 else model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
