"""Benchmarks, reported as ratios measured side by side in one run (this machine is shared
and noisy; absolute times are only indicative).

    python bench/run.py

Rows:
- the CPU golden executor's training-step time per model, fp64 against fp32;
- the simulated NPU's training-step time against the fp32 golden run, per model, for the
  default policy (allow_fp32_to_fp16) and for allow_mix_precision, fusion on
  (target: NPU / golden <= 1.5 on the Transformer);
- the Transformer's NPU step time with a full tensor dump and with a statistics-only dump of
  every step, against no dump (targets <= 1.5 and <= 1.1), at batch 32 and 256, with the
  workspace on the disk of the current directory and on tmpfs (/dev/shm), since creating a
  file costs 20 times more on this machine's disk; each dumping block ends with close(), so
  the time includes the writer catching up.
"""
import os
import shutil
import statistics
import sys
import tempfile
import time

import precision_tool as pt
from precision_tool import hooks

REPEATS, STEPS = 5, 8


def step_time(model, sess, batches, steps):
    times = []
    for _ in range(steps):
        xb, yb = next(batches)
        start = time.perf_counter()
        sess.run([model.loss, model.train_op], {model.x: xb, model.y: yb})
        times.append(time.perf_counter() - start)
    return times


def measure(model, sessions, digits):
    """Median step time per session, the sessions interleaved so all see the same load."""
    batches = {k: iter(list(digits.batches(32, seed=0, epoch=0)) * 100) for k in sessions}
    for k, sess in sessions.items():          # warm up: plans, caches
        step_time(model, sess, batches[k], 2)
    samples = {k: [] for k in sessions}
    for _ in range(REPEATS):
        for k, sess in sessions.items():
            samples[k] += step_time(model, sess, batches[k], STEPS)
    return {k: statistics.median(v) for k, v in samples.items()}


def dump_overhead(digits, where, batch):
    m = pt.models.transformer()
    root = tempfile.mkdtemp(prefix="bench-dump-", dir=where)
    try:
        base = pt.SessionConfig()
        sessions = {"none": pt.Session(m.graph, target="npu", config=base)}
        for data in ("tensor", "stats"):
            cfg = hooks.session_dump_config(base, action="dump", dump_step="all", dump_data=data,
                                            data_dir=root)
            sessions[data] = pt.Session(m.graph, target="npu", config=cfg)
        xb, yb = digits.x_train[:batch], digits.y_train[:batch]
        samples = {k: [] for k in sessions}
        for _ in range(REPEATS):
            for k, sess in sessions.items():
                start = time.perf_counter()
                for _ in range(STEPS):
                    sess.run([m.loss, m.train_op], {m.x: xb, m.y: yb})
                sess.close()
                samples[k].append((time.perf_counter() - start) / STEPS)
        t = {k: statistics.median(v) for k, v in samples.items()}
        return t["tensor"] / t["none"], t["stats"] / t["none"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main():
    digits = pt.data.digits()
    cfg = pt.SessionConfig
    print(f"{'model':12} {'golden fp32 ms':>14} {'fp64/fp32':>10} {'npu default/golden':>19} "
          f"{'npu mixed/golden':>17}")
    for build in (pt.models.mlp, pt.models.cnn, pt.models.transformer):
        m = build()
        sessions = {
            "fp32": pt.Session(m.graph),
            "fp64": pt.Session(m.graph, config=cfg(golden_dtype="float64")),
            "npu": pt.Session(m.graph, target="npu"),
            "npu_mixed": pt.Session(m.graph, target="npu",
                                    config=cfg(precision_mode="allow_mix_precision")),
        }
        t = measure(m, sessions, digits)
        print(f"{m.name:12} {t['fp32'] * 1e3:14.2f} {t['fp64'] / t['fp32']:10.2f} "
              f"{t['npu'] / t['fp32']:19.2f} {t['npu_mixed'] / t['fp32']:17.2f}")
    print()
    print(f"{'dump overhead (Transformer, NPU)':40} {'tensor/none':>12} {'stats/none':>11}")
    for label, where in (("disk (.)", "."), ("tmpfs (/dev/shm)", "/dev/shm")):
        if not os.path.isdir(where):
            continue
        for batch in (32, 256):
            tensor, stats = dump_overhead(digits, where, batch)
            print(f"{f'batch {batch}, workspace on {label}':40} {tensor:12.2f} {stats:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
