"""Benchmarks, reported as ratios measured side by side in one run (this machine is shared
and noisy; absolute times are only indicative).

    python bench/run.py

Rows today: the CPU golden executor's training-step time per model, in fp32 and fp64, and
their ratio. Later rows (NPU simulation, dumps, compare) join this same script.
"""
import statistics
import sys
import time

import precision_tool as pt


def step_times(model, sess, digits, steps, batch_size=32):
    batches = digits.batches(batch_size, seed=0, epoch=0)
    times = []
    for _ in range(steps):
        xb, yb = next(batches)
        start = time.perf_counter()
        sess.run([model.loss, model.train_op], {model.x: xb, model.y: yb})
        times.append(time.perf_counter() - start)
    return times


def main():
    digits = pt.data.digits()
    print(f"{'model':12} {'fp32 step ms':>12} {'fp64 step ms':>12} {'fp64/fp32':>10}")
    for build in (pt.models.mlp, pt.models.cnn, pt.models.transformer):
        m = build()
        sessions = {dt: pt.Session(m.graph, config=pt.SessionConfig(golden_dtype=dt))
                    for dt in ("float32", "float64")}
        for sess in sessions.values():          # warm up: plans, caches
            step_times(m, sess, digits, 2)
        samples = {dt: [] for dt in sessions}
        for _ in range(5):                      # interleaved, so both see the same machine load
            for dt, sess in sessions.items():
                samples[dt] += step_times(m, sess, digits, 8)
        t32, t64 = (statistics.median(samples[dt]) for dt in ("float32", "float64"))
        print(f"{m.name:12} {t32 * 1e3:12.2f} {t64 * 1e3:12.2f} {t64 / t32:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
