"""Replays the precision repair (`fix`) uses against the number of candidates: on the
Transformer with planted causes (real replays), and for the search alone over synthetic
candidate lists (k culprits among n), against k * log2(n)."""
import math
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import precision_tool as pt  # noqa: E402
from precision_tool.analysis.replays import repair as rp  # noqa: E402
from precision_tool.dump import Workspace  # noqa: E402


def _transformer_case(root, mode, scale, layers):
    import scenarios
    scenarios._train(root, pt.models.transformer(layers=layers),
                     pt.SessionConfig(precision_mode=mode), scale=scale)
    return Workspace(root)


def transformer_rows(quick=False):
    """(what, candidates, fix size, replays, seconds) per planted Transformer case."""
    cases = [("allow_mix_precision, raw pixels (softmax overflow)", "allow_mix_precision", 16.0, 1),
             ("force_fp16, features x300 (LayerNorm overflow)", "force_fp16", 300.0, 1)]
    if not quick:
        cases.append(("allow_mix_precision, raw pixels, 2 layers", "allow_mix_precision", 16.0, 2))
    rows = []
    for what, mode, scale, layers in cases:
        ws = _transformer_case(tempfile.mkdtemp(), mode, scale, layers)
        start = time.perf_counter()
        r = rp.repair(ws, ws.run("npu"), ws.run("cpu"), 0, write=False, workers=2,
                      proof_steps=5 if quick else 20)
        seconds = time.perf_counter() - start
        rows.append((what, len(r.candidates), None if r.fix is None else len(r.fix),
                     r.replays, seconds, r.verified))
    return rows


def healthy_row(layers=8, steps=3):
    """`fix` on a healthy step (the Transformer with `layers` layers, standardised digits,
    allow_mix_precision, `steps` steps dumped): (seconds for fix, seconds for one NPU step
    of the same model, whether fix said "none needed" without a replay)."""
    import numpy as np
    root = tempfile.mkdtemp()
    model = pt.models.transformer(layers=layers)
    d = pt.data.digits()
    mean, std = d.x_train.mean(0), d.x_train.std(0) + 1e-6
    import scenarios
    npu, cpu = scenarios._sessions(root, model.graph,
                                   pt.SessionConfig(precision_mode="allow_mix_precision"), steps)
    batches = list(zip(range(steps), d.batches(32, seed=0, epoch=0)))
    for sess in (npu, cpu):
        for _, (xb, yb) in batches:
            sess.run([model.loss, model.train_op], {model.x: (xb - mean) / std, model.y: yb})
        sess.close()
    plain = pt.Session(model.graph, target="npu",
                       config=pt.SessionConfig(precision_mode="allow_mix_precision"))
    xb, yb = batches[0][1]
    feed = {model.x: ((xb - mean) / std).astype(np.float32), model.y: yb}
    plain.run([model.loss, model.train_op], feed)               # compiled and warm
    start = time.perf_counter()
    plain.run([model.loss, model.train_op], feed)
    step = time.perf_counter() - start
    ws = Workspace(root)
    start = time.perf_counter()
    r = rp.repair(ws, ws.run("npu"), ws.run("cpu"), steps - 1, write=False, workers=2)
    seconds = time.perf_counter() - start
    return seconds, step, r.healthy and r.replays == 0


def synthetic_rows(sizes=(16, 64, 256, 1024), culprits=(1, 2, 4), seed=0):
    """(n, k, tests the search used: shortest prefix + minimise + 1-minimal check, k log2 n)."""
    rng = random.Random(seed)
    rows = []
    for n in sizes:
        for k in culprits:
            items = [rp.Change("fp32", f"T{i}") for i in range(n)]
            need = set(rng.sample(items, k))
            used = []

            def test(subsets):
                used.extend(subsets)
                return [need <= set(s) for s in subsets]
            fix = rp.minimize(rp.shortest_prefix(items, test), test)
            assert set(fix) == need and rp.one_minimal(fix, test)
            rows.append((n, k, len(used), k * math.log2(n)))
    return rows


if __name__ == "__main__":
    for row in transformer_rows("--quick" in sys.argv):
        print(row)
    for row in synthetic_rows():
        print(row)
