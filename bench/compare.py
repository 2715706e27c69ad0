"""Compare benchmarks, measured side by side in one run (absolute times on a shared machine
are only indicative; the ratios are the figures).

    python bench/compare.py [--quick]

Rows:
- large fp32 tensors: compare_tensors against one np.dot over the same two arrays (the
  single-pass memory bound), as a fraction (target >= 0.5) and in GB/s;
- small tensors: vector_compare of a real Transformer step dump, in tensor pairs per second
  (target >= 5,000/s), and compare_tensors alone on the same number of small pairs;
- streaming: peak resident memory of a vector_compare (in a fresh process) over a dump whose
  tensors total several times that peak, against the dump's size.
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
from precision_tool import hooks
from precision_tool.analysis import compare_tensors, vector_compare
from precision_tool.dump import Workspace


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def large(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=n).astype(np.float32)
    y = (x + rng.normal(scale=1e-3, size=n)).astype(np.float32)
    t_dot, t_cmp = [], []
    for _ in range(3):                          # interleaved: both see the same load
        t_dot.append(best_of(lambda: np.dot(x, y), 1))
        t_cmp.append(best_of(lambda: compare_tensors(x, y), 1))
    dot, cmp = min(t_dot), min(t_cmp)
    print(f"large fp32 ({n * 4 / 2**20:.0f} MiB per side): compare {cmp:.3f} s, np.dot {dot:.4f} s, "
          f"fraction of the memory bound {dot / cmp:.3f} (target >= 0.5), "
          f"{2 * x.nbytes / cmp / 1e9:.2f} GB/s")


def small(root, layers):
    m = pt.models.transformer(layers=layers)
    d = pt.data.digits()
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="allow_mix_precision"), action="dump", data_dir=root))
    cpu = hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=root)
    feed = {m.x: d.x_train[:32], m.y: d.y_train[:32]}
    npu.run([m.loss, m.train_op], feed)
    cpu.run([m.loss, m.train_op], feed)
    npu.close()
    cpu.close()
    times, rows = [], 0
    for _ in range(3):
        ws = Workspace(root)                    # fresh: the index read is part of the cost
        start = time.perf_counter()
        table = vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
        times.append(time.perf_counter() - start)
        rows = int((table.Verdict != "npu-only").sum())
    t = min(times)
    pairs = [(np.random.default_rng(k).normal(size=256).astype(np.float32),) * 2 for k in range(rows)]
    t_metrics = best_of(lambda: [compare_tensors(a, b * 1.001) for a, b in pairs], 2)
    print(f"small tensors: vector_compare {rows / t:,.0f} pairs/s ({rows} compared rows in {t:.2f} s; "
          f"target >= 5,000/s); compare_tensors alone {rows / t_metrics:,.0f} pairs/s")


def streaming(root, tensors, n):
    g = pt.Graph("stream")
    with g.as_default():
        x = pt.placeholder("x", [n])
        h = x
        for k in range(tensors):
            h = pt.ops.mul(h, 1.0001, name=f"scale_{k}")
    xv = np.random.default_rng(1).normal(size=n).astype(np.float32)
    for sess in (pt.Session(g, target="npu", config=hooks.session_dump_config(
            pt.SessionConfig(precision_mode="force_fp32", fusion_switch="off"), action="dump",
            dump_mode="output",
            data_dir=root)), hooks.sess_dump(pt.Session(g), action="dump", data_dir=root)):
        sess.run(h, {x: xv})
        sess.close()
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)
    # In a fresh process (ru_maxrss would survive exec and report this one's peak): the
    # peak of anonymous memory, sampled every 2 ms (mapped file pages are page cache that the
    # kernel reclaims, so they do not bound what fits), and VmHWM for the record.
    child = f"""
import re, threading, time
from precision_tool.dump import Workspace
from precision_tool.analysis import vector_compare
status = lambda key: int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
base, peak, done = status("RssAnon"), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], status("RssAnon"))
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
ws = Workspace({root!r})
t = vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
done.append(1)
assert (t.Verdict == "pass").sum() >= 2, t.Verdict.tolist()
print(base, max(peak[0], status("RssAnon")), status("VmHWM"))
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the streaming compare failed: {out.stderr.strip().splitlines()[-1]}")
    base, peak, hwm = (int(v) * 1024 for v in out.stdout.split())
    print(f"streaming: dump of {size / 2**20:,.0f} MiB ({tensors} tensors of {n * 4 / 2**20:.0f} MiB "
          f"per side); compare peak anonymous memory {peak / 2**20:,.0f} MiB "
          f"({(peak - base) / 2**20:,.0f} MiB above the interpreter with its imports: the dump is "
          f"{size / max(peak - base, 1):.0f}x that); peak RSS with mapped file pages "
          f"{hwm / 2**20:,.0f} MiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = ap.parse_args()
    large(1 << (20 if args.quick else 25))
    root = tempfile.mkdtemp(dir=".")
    try:
        small(os.path.join(root, "small"), 1 if args.quick else 4)
        streaming(os.path.join(root, "stream"), 3, 1 << (22 if args.quick else 26))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
