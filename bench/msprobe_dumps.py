"""`precision-tool vc` on real msprobe tensor dumps against msprobe's own compare on the same
dumps, whole processes side by side (python bench/msprobe_dumps.py; mindstudio-probe must be
installed: pip install -e ".[msprobe]").

A stack of `layers` Linear+ReLU layers of `width` (a batch of `width` rows: each activation
and weight is width x width float32) trains one step under msprobe's PrecisionDebugger (task
tensor, level L1): once as it is on the CPU (the baseline), once under torch-run on the
simulated NPU. Then, interleaved and `repeats` times each, against a warm page cache:

- msprobe compare -tp NPU/step0 -gp BASELINE/step0 (msprobe's command, every column);
- precision-tool vc -lt NPU -rt BASELINE (the dumps imported by reference once, before the
  timing; -w 1 and -w 2).

The best of each decides; the ratios and the rate (both dumps' bytes / seconds) are printed.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, sys, torch, torch.nn as nn
from msprobe.pytorch import PrecisionDebugger
out, layers, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
json.dump({"task": "tensor", "dump_path": out, "rank": [], "step": [], "level": "L1",
           "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}, open(out + ".json", "w"))
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
debugger = PrecisionDebugger(config_path=out + ".json")
x = torch.randn(width, width)
debugger.start(model)
model(x).square().mean().backward()
opt.step()
debugger.stop()
debugger.step()
"""


def make(work: str, layers: int, width: int) -> tuple:
    script = os.path.join(work, "stack.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT)
    golden, npu = os.path.join(work, "baseline"), os.path.join(work, "npu")
    subprocess.run([sys.executable, script, golden, str(layers), str(width)], check=True,
                   env=env, capture_output=True)
    subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir",
                    os.path.join(work, "npu.ws"), "torch-run", "--target", "npu",
                    "--dump-step", "1000", "--", script, npu, str(layers), str(width)],
                   check=True, env=env, capture_output=True)
    return golden, npu


def size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(argv, cwd) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{argv[0]} failed ({done.returncode}): {done.stderr[-800:]}")
    return took


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    msprobe = shutil.which("msprobe") or os.path.join(os.path.dirname(sys.executable), "msprobe")
    if not os.path.exists(msprobe):
        raise SystemExit("mindstudio-probe is not installed: pip install -e '.[msprobe]'")
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="bench-msprobe-dumps-", dir=where)
    try:
        golden, npu = make(work, args.layers, args.width)
        total = size(os.path.join(golden, "step0")) + size(os.path.join(npu, "step0"))
        ws = os.path.join(work, "ws")
        tool = [sys.executable, "-m", "precision_tool", "--data-dir", ws]
        subprocess.run(tool + ["import", npu, "--as", "npu"], check=True, capture_output=True)
        subprocess.run(tool + ["import", golden, "--as", "cpu"], check=True, capture_output=True)
        commands = {
            "msprobe compare": [msprobe, "compare", "-tp", os.path.join(npu, "step0"),
                                "-gp", os.path.join(golden, "step0"),
                                "-o", os.path.join(work, "msprobe-out")],
            "vc -w 1": tool + ["vc", "-lt", "npu/debug_0", "-rt", "cpu/debug_0", "-w", "1"],
            "vc -w 2": tool + ["vc", "-lt", "npu/debug_0", "-rt", "cpu/debug_0", "-w", "2"],
        }
        times = {name: [] for name in commands}
        for name, argv in commands.items():      # warm: page cache, bytecode
            timed(argv, work)
        for _ in range(args.repeats):
            for name, argv in commands.items():
                times[name].append(timed(argv, work))
        print(f"{args.layers} Linear+ReLU layers of {args.width}x{args.width} float32, one "
              f"training step, msprobe L1 tensor dumps: {total / 2 ** 30:.2f} GiB in both")
        best = {name: min(t) for name, t in times.items()}
        for name, t in times.items():
            print(f"  {name:16s} best {best[name]:7.2f} s  median {statistics.median(t):7.2f} s"
                  f"  {total / best[name] / 2 ** 30:6.2f} GiB/s")
        for name in ("vc -w 1", "vc -w 2"):
            print(f"  msprobe compare / {name}: {best['msprobe compare'] / best[name]:.1f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
