"""Compare benchmarks (run by bench/run.py), measured side by side in one run.

- large fp32 tensors: one pair compared as vc does it against one np.dot over the same two
  memory-mapped arrays (the single-pass memory bound), as a fraction;
- small tensors: vector_compare over a dump of thousands of small pairs, and over a real
  Transformer step, in pairs per second;
- scaling: vector_compare with 1 and 2 worker processes;
- streaming: peak anonymous memory of a vector_compare (in a fresh process) over a dump 4x
  the memory budget.
"""
import math
import os
import subprocess
import sys
import time

import numpy as np

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis import vector_compare
from precision_tool.dump import Workspace


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def large(root, n):
    """A pair of n-element fp32 tensors as vc compares them (files of a workspace, memory-
    mapped, through the engine, with the min and max the dump's index holds) against one
    np.dot over the same mapped arrays."""
    from precision_tool import kernels
    from precision_tool.kernels import native
    from precision_tool.analysis.comparing.engine import Engine, Pair, Side, compare_pairs
    rng = np.random.default_rng(0)
    x = rng.normal(size=n).astype(np.float32)
    y = (x + rng.normal(scale=1e-3, size=n)).astype(np.float32)
    os.makedirs(root, exist_ok=True)
    sides = []
    for name, a in (("x", x), ("y", y)):
        path = os.path.join(root, f"{name}.npy")
        np.save(path, a)
        st = kernels.tensor_stats(a)
        sides.append(Side(path, lo=st["min"], hi=st["max"]))
    del x, y
    ws = Workspace(root)
    xm, ym = ws.load_file(sides[0].path), ws.load_file(sides[1].path)
    pair = Pair(*sides)
    simd = native.simd()

    def portable():                             # the loops CPUs without vector loops run
        os.environ["PRECISION_TOOL_NO_AVX512"] = os.environ["PRECISION_TOOL_NO_AVX2"] = "1"
        native.refresh_simd()
        try:
            compare_pairs(root, [pair], Engine())
        finally:
            del os.environ["PRECISION_TOOL_NO_AVX512"], os.environ["PRECISION_TOOL_NO_AVX2"]
            native.refresh_simd()
    t_dot, t_cmp, t_portable = [], [], []
    for _ in range(3):                          # interleaved: all see the same load
        t_dot.append(best_of(lambda: np.dot(xm, ym), 1))
        t_cmp.append(best_of(lambda: compare_pairs(root, [pair], Engine()), 1))
        if simd:
            t_portable.append(best_of(portable, 1))
    dot, cmp = min(t_dot), min(t_cmp)
    how = (f"{n * 4 / 2**20:.0f} MiB per side, as vc reads them, on {native.threads()} thread(s)"
           f"{f' with the {simd.upper()} loops' if simd else ''}: {8 * n / cmp / 1e9:.2f} GB/s, np.dot "
           f"{8 * n / dot / 1e9:.1f} GB/s")
    if simd:
        how += f"; the portable loops {dot / min(t_portable):.3f}"
    return dot / cmp, how


def dump_both(root, graph, fetches, feeds, precision_mode, dump_mode="output", fusion=False):
    """One run of the graph on the NPU (fusion off unless asked) and on the golden, both
    dumped."""
    config = pt.SessionConfig(precision_mode=precision_mode, fusion_switch=None if fusion else "off")
    for sess in (pt.Session(graph, target="npu", config=hooks.session_dump_config(
            config, action="dump", dump_mode=dump_mode, data_dir=root)),
            hooks.sess_dump(pt.Session(graph), action="dump", data_dir=root)):
        sess.run(fetches, feeds)
        sess.close()


def dump_transformer_step(root, layers=1, pixel_scale=1.0 / 16):
    """One training step of the Transformer (batch 32) under allow_mix_precision with fusion
    on, every tensor of both runs dumped."""
    m = pt.models.transformer(layers=layers)
    d = pt.data.digits(scale=pixel_scale)
    dump_both(root, m.graph, [m.loss, m.train_op], {m.x: d.x_train[:32], m.y: d.y_train[:32]},
              "allow_mix_precision", dump_mode="all", fusion=True)


def compare_rate(root):
    """Pairs per second of vector_compare on the workspace (best of 3, index reads included)."""
    times = []
    for _ in range(3):
        ws = Workspace(root)                    # fresh: the index read is part of the cost
        start = time.perf_counter()
        table = vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
        times.append(time.perf_counter() - start)
    rows = int((table.Verdict != "npu-only").sum())
    return rows / min(times), rows


def small_pairs(root, count, n=256):
    """vector_compare over a dump of `count` small tensors per side (n float32 each)."""
    g = pt.Graph("small")
    with g.as_default():
        x = pt.placeholder("x", [n])
        outs = [pt.ops.mul(x, 1.0 + k * 1e-4, name=f"scale_{k}") for k in range(count)]
    dump_both(root, g, outs, {x: np.random.default_rng(2).normal(size=n).astype(np.float32)},
              "force_fp16")
    rate, rows = compare_rate(root)
    return rate, f"{rows} pairs of {n} elements"


def small(root, layers):
    dump_transformer_step(root, layers)
    rate, rows = compare_rate(root)
    return rate, f"{rows} pairs of one Transformer step ({layers} layers)"


def scaling(root, tensors, n):
    """vector_compare time with 1 worker ÷ with 2 worker processes (2 is linear), in a fresh
    single-threaded process: as the vc command runs it (its workers fork)."""
    _dump_chain(root, tensors, n)
    child = f"""
import threading, time
from precision_tool.analysis import vector_compare
from precision_tool.dump import Workspace
assert threading.active_count() == 1
t = {{}}
for workers in (1, 2) * 3:         # best of three: a run takes a third of a second
    ws = Workspace({root!r})
    start = time.perf_counter()
    vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0, workers=workers)
    elapsed = time.perf_counter() - start
    t[workers] = min(t.get(workers, elapsed), elapsed)
print(t[1], t[2])
"""
    # workers are what scales here: one thread per worker, as the pool's workers have
    env = dict(os.environ, PRECISION_TOOL_THREADS="1")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"the scaling run failed: {out.stderr.strip().splitlines()[-1]}")
    t1, t2 = map(float, out.stdout.split())
    return t1 / t2, (f"{tensors} pairs of {n * 4 / 2**20:.0f} MiB: {t1:.1f} s on 1 worker, "
                     f"{t2:.1f} s on 2 (start-up included)")


def _dump_chain(root, tensors, n):
    g = pt.Graph("stream")
    with g.as_default():
        x = pt.placeholder("x", [n])
        h = x
        for k in range(tensors):
            h = pt.ops.mul(h, 1.0001, name=f"scale_{k}")
    dump_both(root, g, h, {x: np.random.default_rng(1).normal(size=n).astype(np.float32)},
              "force_fp32")


def streaming(root, budget):
    """Peak anonymous memory of a vector_compare over a dump 4x the budget."""
    n = 1 << 26
    tensors = max(1, math.ceil(4 * budget / (2 * n * 4)))
    _dump_chain(root, tensors, n)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)
    # In a fresh process (ru_maxrss would survive exec and report this one's peak): the
    # peak of anonymous memory, sampled every 2 ms (mapped file pages are page cache that the
    # kernel reclaims, so they do not bound what fits), and VmHWM for the record.
    child = f"""
import resource
resource.setrlimit(resource.RLIMIT_DATA, ({budget}, {budget}))   # the budget, enforced
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
    return peak, (f"dump {size / 2**20:,.0f} MiB ({size / budget:.1f}x the {budget / 2**20:.0f} MiB budget); "
                  f"{(peak - base) / 2**20:,.0f} MiB above the interpreter; peak RSS with mapped "
                  f"file pages {hwm / 2**20:,.0f} MiB")


