"""The dump observers: attached to a Session, they write each dumped step into the workspace
through the session's RunWriter (runwriter.py: the run's directory, files and index rows).

An NPU run writes, per dumped step, one .npy per kernel input/output (Ascend's names), an
Opdebug record per overflowing task, index.csv (one row per tensor, with statistics) and a
replay bundle; a golden (CPU) run writes every op's outputs, and the fed placeholders,
under the golden names.

Off the hot path: during a run the session's trace keeps references to the ops' outputs
(executors never modify an array after producing it). When the run ends the observer fills
in the step's plan (stepplan: names, index text and file layout worked out once per
execution plan and shapes) with the step's values, timestamps and paths, and hands it to the
writer, which computes the statistics, writes the files into a hidden partial directory and
renames it into place last, with its index: a step directory exists whole or not at all. A
tensor that several kernels read is written once; the index rows of its readers name that
file.

A statistics dump keeps no values from its second step on: once its step plan is made,
begin_run asks for statistics only (runtime.plan.STATS_ONLY) while the fetches and the feeds'
shapes stay those the plan was made from, the run computes every value's statistics as it
makes it, and the step's rows are gathered from that table.

The writer works while the next step computes. The last step of a finite dump_step is
written before its run() returns; otherwise close() (or the end of the process) waits.
"""
from __future__ import annotations

import glob
import operator
import os
import shutil
import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

import numpy as np

from ..graph import NOT_KERNELS
from ..errors import ExecutionError
from ..runtime.plan import STATS_ONLY
from . import layout
from .stepplan import StepPlan
from .cores import WriterCore
from .runwriter import PARTIAL, Record, RunWriter, op_spec, opdebug, run_json, warn_stopped
from ..train.loss_scale import loss_scale_variable
from .writer import DumpWriteError, close_at_exit, make_writer, write_error

_TIMESTAMP = operator.attrgetter("timestamp")


@dataclass(frozen=True)
class DumpHook:
    """A SessionConfig observer factory: `attach(session)` starts a dump run."""
    settings: layout.DumpSettings

    def attach(self, session):
        return DumpObserver(session, self.settings)


class _Step:
    def __init__(self, number, path, dump, inputs):
        self.number, self.path, self.dump = number, path, dump
        self.inputs = inputs               # the run's fetches and feeds' shapes (see begin_run;
                                           # a statistics dump only)
        self.status = 0                    # OR of the step's status words
        self.loss_scale = None             # (scale, next scale, finite) if the graph scales
        self.bundle = None                 # its replay bundle's files (replay.BundleFiles)


_UNKNOWN = object()       # not looked up yet


class _Traced:
    """What the observer needs of an execution plan, worked out at its first dumped run:
    which nodes scale the loss, and where a run's value of a tensor is."""

    def __init__(self, plan):
        self.plan = plan
        self.scales = [node for node in plan.nodes if node.type == "UpdateLossScale"]

    def source(self, tensor: str, fed: List[str]) -> tuple:
        """Where a run's value of `tensor` is: (plan index, output) of its producer, or
        (len(plan.nodes), position in fed) for a feed."""
        if tensor in fed:
            return len(self.plan.nodes), fed.index(tensor)
        node, _, k = tensor.rpartition(":")
        return self.plan.producers[node], int(k)


class _Reuse(NamedTuple):
    """Where the last StepPlan's values are in a run's trace (see DumpObserver._new_plan)."""
    sources: list           # per tensor: (plan index, output), or (len(plan.nodes), feed)
    fed: list               # the feeds' names, in the order sources count them
    tasks: np.ndarray       # per record (NPU): the index of its task, for its timestamp
    launched: int           # how many tasks the run launched
    records: int
    rows: np.ndarray        # per tensor: its row in a run's statistics (RunTrace.stats)
    inputs: tuple           # the fetches and feeds the plan was made from (_Step.inputs)


class DumpObserver:
    """The session's dump: its run (runwriter.RunWriter), each dumped step planned (StepPlan)
    and handed to the writer."""

    def __init__(self, session, settings: layout.DumpSettings):
        self.settings = settings
        self.target = session.target
        self.npu = session.target == "npu"
        self.stopped: Optional[tuple] = None   # (step, error) once a write failure stopped it
        self._step = None
        self.run_dir = self.files = None
        try:
            self.files = session_run_writer(session, settings)
        except DumpWriteError as e:            # no run directory: nothing to dump into
            self._stop(e, session.step)
            return
        self.run_dir = self.files.run_dir
        self.graph = session.compiled.graph if self.npu else session.graph
        self._steps_dir = self.files.steps_dir()
        self._replay_dir = os.path.join(self.run_dir, "replay", "")
        self.writer = make_writer(max_pending=2)
        self._core = WriterCore()          # BLAS cut to leave the writer a core while dumping
        self._step = None
        self._ops: Dict[str, object] = {}          # per node: its OpSpec, computed once
        self._plan = None                           # the last step's StepPlan
        self._reuse = None                          # where its values are in a run's trace
        self._traced: Dict[int, _Traced] = {}       # by id of the execution plan
        self._bundles = None                        # replay.BundleWriter, made at the first dump
        self._scale_var = _UNKNOWN                  # the loss scale variable's name, or None
        self._scale_before = None                   # its value when an unwatched step began
        close_at_exit(self)

    # -- the observer protocol (main thread: keep it cheap) ----------------------------------
    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes) -> bool:
        acts = self.settings.actions
        number = session.step
        if not (acts & {"dump", "overflow"}) or self.run_dir is None:
            return False
        if self.stopped or not self.settings.wants_step(number):
            # a step not dumped still gets its history row (unwatched_run): the loss scale
            # it starts from is read now, before the run replaces it
            self._scale_before = self._loss_scale(session)
            return False
        path = self._steps_dir + str(number)
        # a statistics dump asks for statistics only while these stay what its plan was
        # made from (below); a tensor dump does not need them
        inputs = (tuple(fetch_tensors), tuple(fetch_nodes),
                  tuple((name, v.shape, v.dtype) for name, v in sorted(feeds.items()))) \
            if self.settings.data == "stats" else None
        self._step = _Step(number, path, "dump" in acts, inputs)
        if self._step.dump:
            if self._bundles is None:
                from .bundle import BundleWriter
                self._bundles = BundleWriter(session)
            self._step.bundle = self._bundles.files(self._replay_dir, str(number), session,
                                                    feeds, fetch_tensors, fetch_nodes,
                                                    self._core.threads())
        # a statistics dump whose last plan was made from the same fetches and feeds' shapes
        # needs no values: the same kernels give tensors of the same shapes (no op's output
        # shape depends on its input's values; _put_step checks the sizes)
        reuse = self._reuse
        if self.settings.data == "stats" and self._step.dump and reuse is not None \
                and reuse.inputs == inputs:
            return STATS_ONLY
        return True

    def end_run(self, session, trace):
        try:
            self._end_run(session, trace)
        except (DumpWriteError, OSError) as e:
            self._stop(e, session.step)

    def _end_run(self, session, trace):
        st, self._step = self._step, None
        traced = self._traced.get(id(trace.plan))
        if traced is None or traced.plan is not trace.plan:
            traced = self._traced[id(trace.plan)] = _Traced(trace.plan)
        for node in traced.scales:       # (scale, good, bad, last, finite) -> (scale, ...)
            st.loss_scale = (trace.scalar(node.inputs[0]), trace.scalar(f"{node.name}:0"),
                             bool(trace.scalar(node.inputs[4])))
        st.status = trace.status
        self.files.observed(st.number, st.status, st.loss_scale, fetched_loss(session.fetched))
        if st.dump or st.status:          # an overflow check writes only steps that overflowed
            self._put_step(st, trace, traced)
        steps = self.settings.steps
        last = steps is not None and st.number >= max(steps)
        if st.dump and not last:
            self._core.limit()          # after the step: see cores (its numbers stay as they were)
        if last:
            self.close()               # the last step of the dump: on disk before run() returns
            if st.dump and os.environ.get(layout.ENV_STOP_AFTER_DUMP):
                raise SystemExit(0)    # check -- SCRIPT: the step it needs is written

    def unwatched_run(self, session):
        """A step outside dump_step: its history row from what the session holds (status
        word, loss scale before and after; the update counts as applied when the status word
        is clear, as the loss-scale gate reads it)."""
        if self._step is not None or self.run_dir is None or \
                not (self.settings.actions & {"dump", "overflow"}):
            return
        status = session.float_status()
        after = self._loss_scale(session)
        scale = (self._scale_before, after, status == 0) if after is not None else None
        self.files.observed(session.step, status, scale, fetched_loss(session.fetched))

    def _loss_scale(self, session) -> Optional[float]:
        """The loss scale variable's current value (None: the graph has no loss scaling)."""
        if self._scale_var is _UNKNOWN:
            self._scale_var = loss_scale_variable(session.graph)
        if self._scale_var is None:
            return None
        return float(np.asarray(session.variables(copy=False)[self._scale_var]).reshape(-1)[0])

    def abort_run(self, session, error):
        self._step = None              # nothing of the failed step is written

    def close(self):
        """Wait until every dumped step is on disk, with the step history and run.json's
        list of dumped steps; a write error stops the dump (_stop). A stopped dump still
        writes the history of the steps observed after it stopped (a few bytes a step)."""
        if self.run_dir is None:
            return
        try:
            if not self.stopped:
                self.writer.flush()
            self.files.finish()
        except (DumpWriteError, OSError) as e:
            if not self.stopped:
                self._stop(e, None)         # a stopped dump has said why already
        finally:
            self._core.restore()

    def _stop(self, error: Exception, step: Optional[int]) -> None:
        """A write failed (a full disk, a directory gone read-only). on_write_error="raise":
        raise it, out of the training step. "stop" (the default): the training goes on and
        the dump ends here, said once on stderr with its cause and the first step it could
        not write; that step's partial files are deleted (a full disk gets its space back)
        and run.json records the stop, so that the run's readers say why steps are missing."""
        error = error if isinstance(error, DumpWriteError) else write_error(error)
        if self.settings.on_write_error == "raise":
            raise error
        if self.stopped:
            return
        files = self.files
        if files is not None:
            step = files.abandon(self.writer, step)
            self._core.restore()
            for partial in glob.glob(glob.escape(self._replay_dir) + ".*" + PARTIAL):
                shutil.rmtree(partial, ignore_errors=True)
        self.stopped = (step, str(error))
        warn_stopped(self.run_dir, step, error, files.dumped_steps if files is not None else [])
        if files is not None:
            try:
                files.stopped(step, str(error))
            except OSError:               # run.json itself cannot be written: said above
                pass

    # -- the writer thread -------------------------------------------------------------------
    def _op(self, node):
        """A node's OpSpec, worked out once per node."""
        spec = self._ops.get(node.name)
        if spec is None:
            spec = self._ops[node.name] = op_spec(self.graph, node)
        return spec

    def _build_plan(self, key, records, mode, tensor_mode) -> StepPlan:
        return self.files.plan(key, records, mode, tensor_mode)

    def _records(self, st: _Step, trace, traced: _Traced, stamp: int):
        """The step's records (Record: node, inputs, outputs, task, timestamp), with where each
        record's outputs are in the trace ((plan index, None), or (len(plan.nodes), position
        in fed) for a feed) and, on the NPU, the index of its task. An NPU step records its
        kernels (an overflow check: those that overflowed); a golden step every op but
        NoOps, and first its fed placeholders, which do not run but whose values the golden
        holds."""
        records, where, tasks = [], [], []
        fed = sorted(trace.feeds)
        if self.npu:
            launched = -1
            for j, (node, inputs, outputs, task) in enumerate(trace.records()):
                launched += task is not None       # the tasks come in the order of their nodes
                if task is None or node.type in NOT_KERNELS or (not st.dump and task.status == 0):
                    continue
                records.append(Record(self._op(node), inputs, outputs, task, task.timestamp))
                where.append((j, None))
                tasks.append(launched)
            return records, where, tasks, fed
        for position, t in enumerate(fed):
            records.append(Record(self._op(self.graph.tensor(t).node), None, [trace.feeds[t]],
                                  None, stamp))
            where.append((len(trace.outputs), position))
        for j, (node, inputs, outputs, _) in enumerate(trace.records()):
            if node.type != "NoOp":
                records.append(Record(self._op(node), inputs, outputs, None, stamp))
                where.append((j, None))
        return records, where, tasks, fed

    def _new_plan(self, key, st, trace, traced, stamp, mode, tensor_mode):
        """A StepPlan for this step (the first, or one whose kernels or shapes changed), and
        where each of its tensors is in a run's trace: later steps of the same execution
        plan gather their values from there without building records."""
        records, where, tasks, fed = self._records(st, trace, traced, stamp)
        plan = self._plan = self._build_plan(key, records, mode, tensor_mode)
        sources = []
        for r, side, k in plan.where:
            j, position = where[r]
            if side == 2:
                sources.append((j, k if position is None else position))
            else:
                sources.append(traced.source(records[r].op.inputs[k], fed))
        nodes, slots = traced.plan.nodes, traced.plan.slots
        rows = np.array([slots[fed[k]] if j == len(nodes) else slots[nodes[j].name] + k
                         for j, k in sources], dtype=np.intp)
        self._reuse = _Reuse(sources, fed, np.array(tasks, dtype=np.intp), len(trace.tasks or ()),
                             len(records), rows, st.inputs)
        return plan, plan.gather(records), [r.timestamp for r in records]

    def _put_step(self, st: _Step, trace, traced: _Traced):
        """On the training thread: the step's plan, values, timestamps and paths (cheap while
        the execution plan and shapes stay the same), handed to the writer, which writes
        every file of the step and of its replay bundle without the GIL."""
        tensor_mode = self.settings.data == "tensor"
        mode = self.settings.mode if st.dump else "all"
        stamp = int(time.time() * 1e6)
        overflowed = [t for t in trace.tasks if t.status and t.type not in NOT_KERNELS] \
            if st.status else []
        key = (traced, mode, tensor_mode, st.dump)
        plan, values = self._plan, None
        reuse = self._reuse
        same = plan is not None and plan.key == key and st.dump and \
            len(trace.tasks or ()) == reuse.launched
        if trace.outputs is None:      # statistics only (begin_run said so)
            # the rows as they are (statistics and size): the index reads the first seven
            values = trace.stats.take(reuse.rows, axis=0) if same else None
            if values is None or not (values[:, 7] == plan.sizes).all():
                raise ExecutionError(
                    f"step {st.number}: the same fetches and feeds gave other kernels or "
                    f"tensors of other sizes than the step before; a statistics dump cannot "
                    f"follow that (use dump_data='tensor')")
        elif same:
            fed = reuse.fed
            pool = trace.outputs + [[trace.feeds[t] for t in fed]] if fed else trace.outputs
            values = [pool[j][k] for j, k in reuse.sources]
            if not plan.fits(values):
                values = None
        if values is None:
            plan, values, stamps = self._new_plan(key, st, trace, traced, stamp, mode, tensor_mode)
        elif self.npu:
            stamps = np.fromiter(map(_TIMESTAMP, trace.tasks), np.int64,
                                 len(trace.tasks))[reuse.tasks]
        else:
            stamps = [stamp] * reuse.records
        partial = self.files.partial_dir(st.number)
        filled = plan.fill(partial, stamps, values) if trace.outputs is not None else \
            plan.fill_stats(partial, stamps, values)
        more = [(os.path.join(partial, layout.opdebug_file_name(t.task_id, t.stream_id,
                                                                t.timestamp)),
                 run_json(opdebug(t.name, t.type, t, t.timestamp, t.status, st.number))
                 .encode("utf-8")) for t in overflowed]
        dirs, renames, links, bundle = [partial], [(partial, st.path)], (), st.bundle
        if bundle is not None:
            more += bundle.files
            dirs.append(bundle.partial)
            links = [bundle.link]
            renames.append((bundle.partial, bundle.path))

        files = self.files
        files.handed_over(st.number)

        def written():
            files.written(st.number)
            if time.monotonic() - files.history_at >= 1.0:
                files.write_history()
        self.writer.put_step(plan, filled, more, links, renames, dirs, written)


def session_run_writer(session, settings: layout.DumpSettings) -> RunWriter:
    """The run a session's dump writes: its target (NPU or GOLDEN), and what run.json
    records of it (the graph, the dump's settings, the configuration; an NPU run's compiled
    graph and fusion record)."""
    cfg, source = session.config, session.graph
    info = {"graph": source.name, "seed": source.seed, "actions": sorted(settings.actions),
            "dump_step": "all" if settings.steps is None else sorted(settings.steps),
            "dump_mode": settings.mode, "dump_data": settings.data,
            "replay_of": settings.replay_of, "values_from": settings.values_from}
    where = dict(debug_dir=settings.debug_dir, first_free=settings.first_free)
    if session.target != "npu":
        info["golden_dtype"] = cfg.golden_dtype
        return RunWriter(settings.root, layout.GOLDEN, info, **where)
    info.update(precision_mode=cfg.precision_mode, amp_level=cfg.amp_level,
                overflow_mode=cfg.overflow_mode, mode=cfg.mode,
                fusion_passes=sorted(session.compiled.fusion),
                numerics="simulated: cube ops accumulate in fp32, vector ops compute in fp32 "
                         "and round per op")
    return RunWriter(settings.root, layout.NPU, info, graph=session.compiled.graph,
                     fusion_result=session.fusion_result(), **where)


def fetched_loss(fetched: Dict[str, np.ndarray]) -> Optional[float]:
    """The step's loss as the history records it: the first float scalar it fetched (a
    training step fetches its loss first), None without one."""
    for value in fetched.values():
        v = np.asarray(value)
        if v.size == 1 and v.dtype.kind == "f" or v.size == 1 and v.dtype.name == "bfloat16":
            return float(v.reshape(-1)[0])
    return None

