"""Big inputs: a dump of 100,000 tensors per side (and, with --big-tensor, one of 2 GiB), then
the commands a user types on it, each in its own process: wall time and peak resident memory.

    python bench/big_inputs.py [--tensors 100000] [--big-tensor]

Not part of bench/run.py (writing 200,000 files takes minutes on this machine's disk).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import precision_tool as pt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import dump_both  # noqa: E402


def dump_wide(root, n):
    """n Mul ops (in blocks of 100 name scopes), every output dumped on both targets."""
    g = pt.Graph("wide")
    with g.as_default():
        x = pt.placeholder("x", [4])
        outs = [pt.ops.mul(x, 1.0 + k * 1e-6, name=f"block_{k // 100}/scale_{k}") for k in range(n)]
    dump_both(root, g, outs, {x: np.ones(4, np.float32)}, "allow_fp32_to_fp16")
    return g


def dump_big(root, elements):
    g = pt.Graph("big")
    with g.as_default():
        x = pt.placeholder("x", [elements])
        y = pt.ops.mul(x, 1.0001, name="scale")
    dump_both(root, g, y, {x: np.random.default_rng(0).normal(size=elements).astype(np.float32)},
              "force_fp32")


_CHILD = """
import re, sys, threading, time
status = lambda key: int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
peak, done = [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], status("RssAnon"))
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
from precision_tool.cli import main
start = time.perf_counter()
code = main(sys.argv[1:])
done.append(1)
print(code, time.perf_counter() - start, max(peak[0], status("RssAnon")), status("VmHWM"), file=sys.stderr)
"""


def measure(root, *argv):
    """Exit code, wall seconds, peak anonymous memory and peak RSS (MiB; RSS counts the
    pages of memory-mapped files, which are page cache) of one command in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _CHILD, "--data-dir", root, "--log-level", "4",
                          *argv], capture_output=True, text=True)
    code, seconds, anon, rss = out.stderr.strip().splitlines()[-1].split()
    return int(code), float(seconds), int(anon) / 1024, int(rss) / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--big-tensor", action="store_true", help="also a single 2 GiB tensor")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-big-", dir=".")
    try:
        root = os.path.join(work, "wide")
        start = time.perf_counter()
        dump_wide(root, args.tensors)
        print(f"dumped {args.tensors:,} tensors per side in {time.perf_counter() - start:.0f} s")
        step_dir = next(dp for dp, _, fs in os.walk(os.path.join(root, "cpu")) if "index.csv" in fs)
        file = os.path.join(step_dir, next(f for f in sorted(os.listdir(step_dir)) if f.endswith(".npy")))
        cases = [("ls", ["ls"]), ("ls -n scale_99999", ["ls", "-n", f"scale_{args.tensors - 1}"]),
                 ("ni block_7/scale_777", ["ni", "block_7/scale_777"]),
                 ("pt <golden file path>", ["pt", file]),
                 ("vc", ["vc"]), ("vcs -l 10", ["vcs", "-l", "10"])]
        print(f"{'command':36} {'exit':>4} {'seconds':>8} {'peak anon MiB':>14} {'peak RSS MiB':>13}")
        for label, argv in cases:
            code, seconds, anon, rss = measure(root, *argv)
            print(f"{label:36} {code:4d} {seconds:8.2f} {anon:14.0f} {rss:13.0f}")
        if args.big_tensor:
            big = os.path.join(work, "big")
            dump_big(big, 1 << 29)                    # 2 GiB of float32 per side
            for label, argv in (("ls", ["ls"]), ("ni scale", ["ni", "scale"]),
                                ("pt scale (NPU output)", ["pt", "scale"]), ("vc", ["vc"]),
                                ("vcs", ["vcs"])):
                code, seconds, anon, rss = measure(big, *argv)
                print(f"{'2 GiB tensor: ' + label:36} {code:4d} {seconds:8.2f} {anon:14.0f} {rss:13.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
