"""Executor benchmarks (run by bench/run.py): step-time ratios measured side by side.

- the simulated NPU's training-step time against the fp32 golden run, per model, for the
  default policy (allow_fp32_to_fp16) and for allow_mix_precision, fusion on;
- the Transformer's NPU step time with a full tensor dump and with a statistics-only dump of
  every step, against no dump, at batch 32 and 256, with the workspace on the disk of the
  current directory and on tmpfs (/dev/shm); each dumping block ends with close(), so the
  time includes the writer catching up; each block's first step is run untimed before it
  (START) (on tmpfs its steps are then removed, untimed: see
  _drop_steps); the floor under a tensor dump (an observer that only
  keeps each step's outputs until the next step ends) and under a statistics dump (one that
  only asks for the values' statistics, which the run computes as it makes them); a
  statistics dump also in one session that dumps every other step (the steadiest measure
  here); and the writer thread's CPU time per step;
- the golden executor against PyTorch CPU eager, when torch is installed.
"""
import dataclasses
import glob
import os
import shutil
import statistics
import tempfile
import time

import precision_tool as pt
from precision_tool import hooks
from precision_tool.runtime.plan import STATS_ONLY

REPEATS, STEPS = 5, 8
# the dump blocks end with the writer catching up, and this shared machine's load drifts
# from second to second: more, longer blocks give a median that moves less between runs.
# A block of a quarter of a second or so, whatever the batch: a dump's close (its history,
# run.json, the BLAS threads given back: about 1 ms) is a cost per block, not per step,
# and was 2% of a 12-step block at batch 32.
DUMP_REPEATS = 9
DUMP_STEPS = {32: 48, 256: 12}
# OpenBLAS keeps its idle threads spinning for about 0.1 s after a call: a block measured
# right after a block that ran BLAS on both cores would share a core with that spinner. A
# dump limits BLAS to leave its writer a core (dump/cores.py); in a training run the spin
# after that is a one-off at the dump's start. The dump blocks start after this pause, as
# every block does, so each measures its steady state.
BLAS_SPIN = 0.15
# START: every block is a dump of its own (closed at its end), and a dump's first step runs
# with every BLAS thread, whose idle threads then spin beside the writer for about 0.1 s
# (dump/cores.py: the dumped step keeps the undumped run's numbers). Once per dump, that is
# no step time, but a block of under a second would count it as such (the tensor blocks at
# batch 32 read 1.20-1.24 with it, 1.11-1.13 without). So each block, of every session alike,
# starts with one untimed step, then the BLAS_SPIN pause.


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


class _KeepSteps:
    """The floor of any dump that writes off the training thread: an observer that only
    keeps each step's outputs (its run trace) until the next step ends, as a dump keeps them
    until its writer has them, and does nothing else."""

    @staticmethod
    def attach(session):
        return _KeepSteps()

    def __init__(self):
        self.kept = None

    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes):
        return True

    def end_run(self, session, trace):
        self.kept = trace

    def abort_run(self, session, error):
        pass

    def close(self):
        self.kept = None


class _StatsOnly(_KeepSteps):
    """The floor of a statistics dump: an observer that asks for the values' statistics
    (the run computes them as it makes each value and keeps none) and does nothing else."""

    @staticmethod
    def attach(session):
        return _StatsOnly()

    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes):
        return STATS_ONLY


def dump_overhead(digits, where, batch):
    """Step time of a tensor dump, a stats dump, _KeepSteps and _StatsOnly, each ÷ no dump."""
    m = pt.models.transformer()
    root = tempfile.mkdtemp(prefix="bench-dump-", dir=where)
    try:
        base = pt.SessionConfig()
        sessions = {"none": pt.Session(m.graph, target="npu", config=base),
                    "kept": pt.Session(m.graph, target="npu",
                                       config=dataclasses.replace(base, observers=(_KeepSteps,))),
                    "counted": pt.Session(m.graph, target="npu",
                                          config=dataclasses.replace(base, observers=(_StatsOnly,)))}
        for data in ("tensor", "stats"):
            cfg = hooks.session_dump_config(base, action="dump", dump_step="all", dump_data=data,
                                            data_dir=root)
            sessions[data] = pt.Session(m.graph, target="npu", config=cfg)
        xb, yb = digits.x_train[:batch], digits.y_train[:batch]
        steps = DUMP_STEPS.get(batch, 12)
        samples = {k: [] for k in sessions}
        for _ in range(DUMP_REPEATS):
            for k, sess in sessions.items():
                sess.run([m.loss, m.train_op], {m.x: xb, m.y: yb})     # untimed: see START
                time.sleep(BLAS_SPIN)
                start = time.perf_counter()
                for _ in range(steps):
                    sess.run([m.loss, m.train_op], {m.x: xb, m.y: yb})
                sess.close()
                samples[k].append((time.perf_counter() - start) / steps)
                if where != ".":
                    _drop_steps(root)
        t = {k: statistics.median(v) for k, v in samples.items()}
        return tuple(t[k] / t["none"] for k in ("tensor", "stats", "kept", "counted"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _drop_steps(root):
    """Remove the steps a block wrote to tmpfs (untimed): memory this virtual machine has
    not used for a while is mapped by the host as it is first written, at about 0.45 GB/s
    (dd here), and a workspace kept across the blocks grows to gigabytes (a tensor dump at
    batch 256 writes 28 MB a step): from about 1 GB on, the blocks measured that rate
    instead of the dump (4-5x at batch 256). The run directories stay: the next block
    writes its steps beside them."""
    for step in glob.glob(os.path.join(root, "npu", "*", "dump", "*", "*", "*", "*", "*")) + \
            glob.glob(os.path.join(root, "npu", "*", "replay", "*")):
        shutil.rmtree(step, ignore_errors=True)


def _writer_cpu_seconds():
    """CPU seconds of the C module's writer threads: their scheduler run time from /proc
    (nanoseconds; clock ticks, 10 ms, where schedstat is missing)."""
    from precision_tool.kernels import native
    total = 0.0
    for task in native.writer_threads():
        try:
            try:
                with open(f"{task}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
                    continue
            except OSError:
                pass
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:             # the thread ended meanwhile
            continue
    return total


@dataclasses.dataclass(frozen=True)
class _EveryOtherHook:
    """A SessionConfig observer factory: the hook's observer, watching every other step."""
    inner: object

    def attach(self, session):
        return _EveryOther(self.inner.attach(session))


class _EveryOther:
    """A dump observer that watches every other step: the steps between run undumped."""

    def __init__(self, inner):
        self.inner, self.on = inner, False

    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes):
        self.on = not self.on
        return self.on and self.inner.begin_run(session, feeds, fetch_tensors, fetch_nodes)

    def end_run(self, session, trace):
        self.inner.end_run(session, trace)

    def abort_run(self, session, error):
        self.inner.abort_run(session, error)

    def close(self):
        close = getattr(self.inner, "close", None)       # a watch has nothing to finish
        if close is not None:
            close()


def _alternating(sess, m, digits, batch, pairs):
    """The median over the observed (even) steps of each one's time ÷ the mean of its two
    unobserved neighbours', from step 4 on (the first observed steps make the plan)."""
    feed = {m.x: digits.x_train[:batch], m.y: digits.y_train[:batch]}
    times = []
    for _ in range(2 * pairs + 5):
        start = time.perf_counter()
        sess.run([m.loss, m.train_op], feed)
        times.append(time.perf_counter() - start)
    sess.close()
    return statistics.median(times[i] / ((times[i - 1] + times[i + 1]) / 2)
                             for i in range(4, len(times) - 1, 2))


def stats_dump_alternating(digits, where, batch, pairs=300):
    """A statistics dump's step ÷ an undumped one, in one session that dumps every other
    step: the same plan, arrays and caches on both sides, so the steadiest measure on a
    shared machine. The median over dumped steps of each one's time ÷ the mean of the two
    undumped steps around it: this machine's speed drifts from second to second, and a
    step's neighbours ran at the speed it ran at. The writer's close is not in it."""
    m = pt.models.transformer()
    root = tempfile.mkdtemp(prefix="bench-dump-", dir=where)
    try:
        cfg = hooks.session_dump_config(pt.SessionConfig(), action="dump", dump_step="all",
                                        dump_data="stats", data_dir=root)
        cfg = dataclasses.replace(cfg, observers=tuple(map(_EveryOtherHook, cfg.observers)))
        return _alternating(pt.Session(m.graph, target="npu", config=cfg), m, digits, batch, pairs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def watch_alternating(digits, batch, pairs=300):
    """A watched Transformer NPU step ÷ an unwatched one (every watchpoint condition on), in
    one session that watches every other step, measured as stats_dump_alternating measures:
    the median over watched steps of each one's time ÷ the mean of its two neighbours'."""
    m = pt.models.transformer()
    root = tempfile.mkdtemp(prefix="bench-watch-")
    try:
        cfg = hooks.watch(pt.SessionConfig(), data_dir=root)
        cfg = dataclasses.replace(cfg, observers=tuple(map(_EveryOtherHook, cfg.observers)))
        return _alternating(pt.Session(m.graph, target="npu", config=cfg), m, digits, batch, pairs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def writer_cpu(digits, where, batch, steps=40):
    """CPU time per Transformer step, for a tensor dump and a stats dump, of the dump's writer
    thread (the C module's, by its name in /proc; Linux only: None elsewhere, or without the
    C module) and of the training thread beyond an undumped step's (with BLAS limited as a
    dump limits it), each over `steps` steps after two of warm-up. What the dump costs in
    CPU, whatever else the machine is doing: wall-time ratios move by 10-20% from run to
    run here."""
    from precision_tool.kernels import native
    if not native.enabled() or not os.path.isdir("/proc/self/task"):
        return None
    m = pt.models.transformer()
    root = tempfile.mkdtemp(prefix="bench-writer-", dir=where)
    feed = {m.x: digits.x_train[:batch], m.y: digits.y_train[:batch]}
    try:
        def main_cpu(sess):
            for _ in range(2):
                sess.run([m.loss, m.train_op], feed)
            sess.close()
            start, writer = time.thread_time(), _writer_cpu_seconds()
            for _ in range(steps):
                sess.run([m.loss, m.train_op], feed)
            sess.close()
            return (time.thread_time() - start) / steps, \
                (_writer_cpu_seconds() - writer) / steps
        from precision_tool.dump.cores import WriterCore
        core = WriterCore()         # the undumped step with BLAS as a dump leaves it: else
        core.limit()                # the training thread does BLAS work a worker did
        try:
            base, _ = main_cpu(pt.Session(m.graph, target="npu"))
        finally:
            core.restore()
        out = {}
        for data in ("tensor", "stats"):
            cfg = hooks.session_dump_config(pt.SessionConfig(), action="dump", dump_step="all",
                                            dump_data=data, data_dir=root)
            training, writer = main_cpu(pt.Session(m.graph, target="npu", config=cfg))
            out[data] = (writer, training - base)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def step_ratios(digits, quick):
    """(rows) NPU ÷ golden per model and policy; fp64 ÷ fp32 for the record."""
    cfg = pt.SessionConfig
    rows = []
    for build in ((pt.models.transformer,) if quick else
                  (pt.models.mlp, pt.models.cnn, pt.models.transformer)):
        m = build()
        sessions = {
            "fp32": pt.Session(m.graph),
            "npu": pt.Session(m.graph, target="npu"),
            "npu_mixed": pt.Session(m.graph, target="npu",
                                    config=cfg(precision_mode="allow_mix_precision")),
        }
        t = measure(m, sessions, digits)
        rows.append((f"NPU-simulated ÷ CPU-golden step time, {m.name}, allow_fp32_to_fp16",
                     t["npu"] / t["fp32"], f"golden step {t['fp32'] * 1e3:.2f} ms"))
        rows.append((f"NPU-simulated ÷ CPU-golden step time, {m.name}, allow_mix_precision",
                     t["npu_mixed"] / t["fp32"], ""))
    return rows


def torch_ratio(digits):
    """Golden step time ÷ PyTorch CPU eager on the same MLP and CNN, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    import numpy as np
    torch.set_num_threads(1)
    rows = []
    for name in ("mlp", "cnn"):
        m = getattr(pt.models, name)()
        if name == "mlp":
            net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        else:
            net = torch.nn.Sequential(
                torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 16, 3, padding=1, bias=False),
                torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(16, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32),
                torch.nn.ReLU(), torch.nn.AvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(128, 10))
        opt = torch.optim.Adam(net.parameters(), 0.01)
        xb = torch.from_numpy(np.ascontiguousarray(digits.x_train[:32]))
        yb = torch.from_numpy(digits.y_train[:32].astype(np.int64))

        def torch_step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
        sess = pt.Session(m.graph)
        feed = {m.x: digits.x_train[:32], m.y: digits.y_train[:32]}
        ours, theirs = [], []
        for _ in range(REPEATS):
            for fn, acc in ((lambda: sess.run([m.loss, m.train_op], feed), ours), (torch_step, theirs)):
                start = time.perf_counter()
                for _ in range(STEPS):
                    fn()
                acc.append((time.perf_counter() - start) / STEPS)
        rows.append((f"CPU-golden ÷ PyTorch eager step time, {name}",
                     statistics.median(ours) / statistics.median(theirs), ""))
    return rows
