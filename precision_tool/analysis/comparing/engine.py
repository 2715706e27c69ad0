"""Where the tensor comparisons of a vector compare run: in this process (the default), in a
pool of local worker processes, or on a Dask cluster (`pip install ".[cluster]"`).

The work is a list of tasks that name files, never arrays: a worker opens the dump itself,
through the same reader (allow_pickle=False, nothing outside the workspace), from storage it
shares with the client. A pair of tensors is one task; a pair too large for one worker to
read in good time (SPLIT_ELEMENTS, when neither side needs a 5HD conversion) is split into
ranges: tasks of ranges for everything but KL, whose ranges merge into the totals of the
whole tensor; then tasks of ranges for KL's second pass, which needs the whole tensor's min
and max (unless the index's min and max, given to the first pass, proved right). Workers
take one range a task; this process takes several in one task (GROUP_ELEMENTS), whose parts
keep its threads busy to the end. The split does not depend on where the tasks run and the
ranges merge in order, so every engine gives the same numbers, bit for bit.
"""
from __future__ import annotations

import os
import signal
import zlib
from typing import Callable, Dict, List, NamedTuple, Optional

import numpy as np

from ... import kernels, numerics
from ...collector import collector_paused
from ...dump.formats import npy_header
from ...dump.workspace import Workspace, WorkspaceError, in_row_shape
from .verdicts import UNREADABLE
from ...kernels.totals import Totals, add_kl_sums, span_kl, span_totals
from .metrics import compare_many, compare_tensors, empty_result, finish

SPLIT_ELEMENTS = 1 << 24        # tensors above this are compared in ranges of RANGE_ELEMENTS
RANGE_ELEMENTS = 1 << 23
GROUP_ELEMENTS = 1 << 25        # in this process a task takes ranges of up to this many elements
BATCH_BYTES = 1 << 18           # pairs whose files are both this small go in batches ...
BATCH_PAIRS = 256               # ... of at most this many
# A compare only reads its tensors, so a file above this is mapped rather than copied out of
# the page cache into fresh memory: from about 1 MiB the mapping is the cheaper, below it the
# mapping's own set-up costs more than the copy (docs/design-notes.md has the figures).
MAP_BYTES = 1 << 20
# A pool of worker processes costs its start and a round trip per task: work that this
# process would finish in under POOL_SECONDS runs here, whatever -w asks. The estimate of
# that time takes a rate per byte read on each of its threads and one per pair (bench/run.py
# measures both).
POOL_SECONDS = 0.5
HERE_BYTES_PER_SECOND = 1.5e9
HERE_PAIRS_PER_SECOND = 8000.0


class EngineError(WorkspaceError):
    """The compare engine cannot run as asked (no Dask, an unreachable scheduler...)."""


def logical_tensor(value: np.ndarray, fmt: str, original_shape: str) -> np.ndarray:
    """A dumped tensor in its logical layout: NC1HWC0 back to NCHW, others unchanged."""
    if fmt == "NC1HWC0" and original_shape:
        channels = int(original_shape.split()[1])     # the batch may be unknown ("None")
        n, _, h, w, _ = value.shape
        return numerics.five_hd_to_nchw(value, (n, channels, h, w))
    return value


class Side(NamedTuple):
    """One tensor file of a pair (a tuple: a compare of many small pairs makes thousands)."""
    path: str                   # absolute path of the .npy
    fmt: str = ""               # NC1HWC0 is converted to NCHW before comparing
    original_shape: str = ""
    lo: float = float("nan")    # min and max as the dump index says: a hint that spares
    hi: float = float("nan")    # KL its second pass when it proves right
    nbytes: int = -1            # its data's size as the index says (-1: unknown, stat it):
                                # where it goes is planned without a stat per file
    crc: str = ""               # the CRC32 of its data the dump recorded (msprobe's "md5")
    shape: Optional[str] = None  # its index line's (a linked view's file holds another)


class Pair(NamedTuple):
    npu: Side
    golden: Side

    def ranges(self) -> Optional[tuple]:
        """The KL ranges the index promises (lo_x, hi_x, lo_y, hi_y), or None."""
        r = (self.npu.lo, self.npu.hi, self.golden.lo, self.golden.hi)
        return r if all(np.isfinite(r)) else None


def _load(ws: Workspace, side: Side) -> np.ndarray:
    value = ws.load_file(side.path, MAP_BYTES)
    if side.crc:
        got = f"{zlib.crc32(np.ascontiguousarray(value).data) & 0xffffffff:08x}"
        if got != side.crc.lower():
            raise WorkspaceError(f"tensor file {side.path} does not hold what was dumped: its "
                                 f"CRC32 is {got}, the dump recorded {side.crc} (changed or "
                                 f"damaged since)")
    return logical_tensor(in_row_shape(value, side.shape), side.fmt, side.original_shape)


def _failed(reason: str) -> dict:
    out = empty_result()
    out["CompareFailReason"] = UNREADABLE + reason
    return out


def _flat(ws, pair):
    x, y = _load(ws, pair.npu), _load(ws, pair.golden)
    return x.reshape(-1), y.reshape(-1)


def _batch(ws: Workspace, pairs: List[Pair]) -> List[dict]:
    loaded, rows = [], [None] * len(pairs)
    for k, pair in enumerate(pairs):
        try:
            loaded.append((k, _load(ws, pair.npu), _load(ws, pair.golden)))
        except WorkspaceError as e:
            rows[k] = _failed(str(e))
    for (k, _, _), row in zip(loaded, compare_many([(x, y) for _, x, y in loaded])):
        rows[k] = row
    return rows


def run_task(task):
    """One task, anywhere: ("batch", root, [pairs]) -> result rows; ("pair", root, pair) ->
    result row; ("totals", root, pair, spans) -> Totals per (start, stop) of spans; ("kl",
    root, pair, spans, ranges) -> KL sums per span. An unreadable file is a result with its
    reason, not an exception."""
    kind, root, pair = task[:3]
    # the reader's checks, wherever the task runs; root: a path, or Workspace.where
    ws = Workspace(*root) if isinstance(root, tuple) else Workspace(root)
    if kind == "batch":
        with collector_paused():         # a worker's share of compare_step's containers
            return _batch(ws, pair)
    try:
        if kind == "pair":
            return compare_tensors(_load(ws, pair.npu), _load(ws, pair.golden), pair.ranges())
        xs, ys = _flat(ws, pair)
        if kind == "totals":
            return span_totals(xs, ys, task[3], ranges=pair.ranges())
        return span_kl(xs, ys, task[3], task[4])
    except WorkspaceError as e:
        return _failed(str(e))


def _bytes(side: Side) -> int:
    """The side's size, for planning: the index's where it said (a file that is larger than
    that is still mapped, not read whole, when it is loaded), else the file's."""
    if side.nbytes >= 0:
        return side.nbytes
    try:
        return os.path.getsize(side.path)
    except OSError:
        return 0                  # missing: its task reports it


def _size(side: Side) -> Optional[int]:
    """Elements of a plain tensor from its npy header (None: not splittable)."""
    if side.fmt == "NC1HWC0":
        return None
    try:
        shape, _, _ = npy_header(side.path)
    except (OSError, ValueError):
        return None              # the pair task reports what is wrong with it
    return int(np.prod(shape, dtype=np.int64))


class Engine:
    """map(tasks) -> results in task order; subclasses decide where tasks run."""

    def tasks_of(self, spans: List[tuple]) -> List[List[tuple]]:
        """A split tensor's ranges grouped into tasks: here GROUP_ELEMENTS' worth a task
        (their parts share this process's threads, and the file pages a task maps stay
        resident until it ends); an engine with workers gives each range a task."""
        per = max(1, GROUP_ELEMENTS // RANGE_ELEMENTS)
        return [spans[k:k + per] for k in range(0, len(spans), per)]

    def map(self, tasks: List[tuple], done: Callable[[int], None],
            seconds: Optional[float] = None) -> List:
        """The tasks' results in task order; `seconds`: how long they would take in this
        process (an estimate, for an engine that may then keep them here)."""
        results = [None] * len(tasks)
        for k, result in self._unordered(tasks):
            results[k] = result
            done(k)
        return results

    def _unordered(self, tasks):
        # a pair's C pass runs without the GIL: pairs run side by side on the threads one
        # large pair would use; ranges of a split pair thread themselves, a batch is Python
        pairs = [k for k, task in enumerate(tasks) if task[0] == "pair"]
        threads = min(kernels.threads(), len(pairs))
        if threads > 1:
            from concurrent.futures import ThreadPoolExecutor, as_completed
            with ThreadPoolExecutor(threads) as pool:
                futures = {pool.submit(run_task, tasks[k]): k for k in pairs}
                for f in as_completed(futures):
                    yield futures[f], f.result()
        else:
            pairs = []
        done = set(pairs)
        for k, task in enumerate(tasks):
            if k not in done:
                yield k, run_task(task)

    def close(self):
        pass


def ignore_interrupts() -> None:
    """In a pool's worker: Ctrl-C is the parent's to handle (one line, exit 130, the pool
    shut down), not each worker's to print a traceback of."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _one_thread():
    os.environ["PRECISION_TOOL_THREADS"] = "1"     # the pool's workers already fill the cores
    ignore_interrupts()


class _WorkerEngine(Engine):
    def tasks_of(self, spans: List[tuple]) -> List[List[tuple]]:
        return [[span] for span in spans]          # one range a task: the workers share them


class ProcessEngine(_WorkerEngine):
    """A pool of `workers` local processes, started when work worth it first comes."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = None

    def map(self, tasks: List[tuple], done: Callable[[int], None],
            seconds: Optional[float] = None) -> List:
        if seconds is not None and seconds < POOL_SECONDS:
            return Engine().map(tasks, done)          # not worth a pool: here
        return super().map(tasks, done)

    def start(self):
        """Start the pool now (it starts itself when work worth it comes)."""
        import multiprocessing
        import threading
        from concurrent.futures import ProcessPoolExecutor
        # fork starts a worker in milliseconds (spawn re-imports numpy and pandas: a second
        # or more each), but it copies the locks of other threads as they are: only fork
        # from a single-threaded process (a dump writer may be running in a training script,
        # in Python or in the C module, which threading does not see)
        single = threading.active_count() == 1 and not kernels.writer_running() \
            and "fork" in multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if single else "spawn")
        self.pool = ProcessPoolExecutor(self.workers, mp_context=context,
                                        initializer=_one_thread)

    def _unordered(self, tasks):
        from concurrent.futures import as_completed
        if self.pool is None:
            self.start()
        futures = {self.pool.submit(run_task, t): k for k, t in enumerate(tasks)}
        for f in as_completed(futures):
            yield futures[f], f.result()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


class DaskEngine(_WorkerEngine):
    def __init__(self, scheduler):
        try:
            from distributed import Client
        except ImportError:
            raise EngineError('a Dask scheduler was given but Dask is not installed: '
                              'pip install "precision_tool[cluster]"') from None
        if isinstance(scheduler, str):
            try:
                self.client = Client(scheduler, timeout=10)
            except (OSError, TimeoutError) as e:
                raise EngineError(f"cannot reach the Dask scheduler {scheduler}: {e}") from None
            self._own = True
        else:                      # a Client already connected
            self.client, self._own = scheduler, False

    def _unordered(self, tasks):
        from distributed import as_completed
        futures = self.client.map(run_task, tasks, pure=False)
        index = {f.key: k for k, f in enumerate(futures)}
        for f in as_completed(futures):
            yield index[f.key], f.result()

    def close(self):
        if self._own:
            self.client.close()


def engine_for(workers: int = 1, scheduler=None) -> Engine:
    if scheduler is not None:
        return DaskEngine(scheduler)
    if workers > 1:
        return ProcessEngine(workers)
    return Engine()


def compare_pairs(root: str, pairs: List[Pair], engine: Engine,
                  progress: Optional[Callable[[int, int], None]] = None) -> List[dict]:
    """The compare_tensors row of every pair, in order."""
    root = tuple(root) if isinstance(root, (tuple, list)) else os.path.abspath(root)
    plans: List[tuple] = []    # per pair: ("pair", task, slot) or ("split", [tasks], ranges)
    tasks: List[tuple] = []
    batch: List[int] = []      # pairs waiting for a batch task

    def flush():
        if batch:
            for slot, p in enumerate(batch):
                plans[p] = ("pair", len(tasks), slot)
            tasks.append(("batch", root, [pairs[p] for p in batch]))
            batch.clear()

    read = 0                   # bytes the tasks read: how long they take here
    for p, pair in enumerate(pairs):
        plans.append(None)
        sizes = _bytes(pair.npu), _bytes(pair.golden)
        read += sum(sizes)
        if max(sizes) <= BATCH_BYTES:
            batch.append(p)
            if len(batch) == BATCH_PAIRS:
                flush()
            continue
        n = _size(pair.npu)
        if n is not None and n > SPLIT_ELEMENTS and _size(pair.golden) == n:
            groups = engine.tasks_of([(s, min(s + RANGE_ELEMENTS, n))
                                      for s in range(0, n, RANGE_ELEMENTS)])
            plans[p] = ("split", list(range(len(tasks), len(tasks) + len(groups))), groups)
            tasks += [("totals", root, pair, spans) for spans in groups]
        else:
            plans[p] = ("pair", len(tasks), None)
            tasks.append(("pair", root, pair))
    flush()
    finished = [0]
    whole = {}            # task -> how many pairs it finishes (batches and single pairs)
    for plan in plans:
        if plan[0] == "pair":
            whole[plan[1]] = whole.get(plan[1], 0) + 1

    def done(k):
        if k in whole:
            finished[0] += whole[k]
            if progress is not None:
                progress(finished[0], len(pairs))

    here = read / (HERE_BYTES_PER_SECOND * kernels.threads()) + len(pairs) / HERE_PAIRS_PER_SECOND
    first = engine.map(tasks, done, here)
    results: Dict[int, dict] = {}
    kl_tasks, kl_owner, totals = [], [], {}
    for p, plan in enumerate(plans):
        if plan[0] == "pair":
            result = first[plan[1]]
            results[p] = result if plan[2] is None else result[plan[2]]
            continue
        failed = next((first[k] for k in plan[1] if isinstance(first[k], dict)), None)
        if failed is not None:
            results[p] = failed
            continue
        t = Totals()
        for k in plan[1]:                  # in range order: the same sums wherever they ran
            for part in first[k]:
                t.merge(part)
        totals[p] = t
        if t.early_kl():
            t.set_kl(t.early_kl())
        elif t.n:
            for spans in plan[2]:
                kl_tasks.append(("kl", root, pairs[p], spans, t.ranges()))
                kl_owner.append(p)
    if kl_tasks:
        sums = engine.map(kl_tasks, lambda k: None, here / 2)
        per_pair: Dict[int, tuple] = {}
        for p, parts in zip(kl_owner, sums):
            if isinstance(parts, dict):
                results[p] = parts
                continue
            for part in parts:
                per_pair[p] = add_kl_sums(per_pair[p], part) if p in per_pair else part
        for p, s in per_pair.items():
            totals[p].set_kl(s)
    for p, t in totals.items():
        if p not in results:
            results[p] = finish(t)
            finished[0] += 1
            if progress is not None:
                progress(finished[0], len(pairs))
    return [results[p] for p in range(len(plans))]
