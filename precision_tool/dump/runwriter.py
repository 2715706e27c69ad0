"""Writing a run into a workspace, whoever computed its values: the seam every front-end
writes through.

A RunWriter claims <workspace>/<target>/debug_<k> and writes run.json (what ran, under which
configuration; its list of dumped steps kept up to date), a device run's compiled graph and
fusion result, the step history (step_history.csv: status word, loss scale and loss of every
observed step, dumped or not) and the steps: index.csv rows beside the tensor files (or
statistics only), each step whole or not at all (a hidden partial directory renamed into
place last). It knows nothing of a Session. The dump observer (dumper.py) makes one from a
session and hands its steps' plans to a writer thread; the ONNX job hands ONNX Runtime's
values to write_step; a new front-end describes its ops as OpSpecs and does the same.
"""
from __future__ import annotations

import bisect
import csv
import glob
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from .. import kernels, numerics
from ..collector import collector_paused
from ..fileio import write_text_atomic
from ..table import csv_field
from .writer import write_error
from ..version import __version__
from . import layout
from .stepplan import SPILL_DIR, Row, Spilled, StepPlan, Summary, disk_dtype

_STATS = list(kernels.STAT_FIELDS)
# a device run's index (Ascend's names and tasks) and a reference run's
NPU_COLUMNS = ["op_type", "op_name", "task_id", "stream_id", "timestamp", "io", "index",
               "tensor", "dtype", "format", "shape", "original_shape", "pass_name", "file"] + _STATS
CPU_COLUMNS = ["op_type", "op_name", "timestamp", "io", "index", "tensor", "dtype", "shape",
               "file"] + _STATS
PARTIAL = ".partial"
STAMP = "\0"        # the timestamp's place in a file name template (mangled names hold no NUL)


def _announce(run_dir: str) -> None:
    """Name the run in the script runner's file, when a runner started this process (one
    short append: whole lines even when several runs of the script start at once)."""
    path = os.environ.get(layout.ENV_RUNS_FILE)
    if path:
        line = os.path.abspath(run_dir) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode("utf-8"))
        finally:
            os.close(fd)


def warn_stopped(run_dir: Optional[str], step: Optional[int], error, on_disk: List[int],
                 instead: str = "on_write_error='raise' stops the training instead") -> None:
    """The one warning a dump that cannot write (a full disk) gives as it stops: the step,
    the run, the cause, and what is on disk; the training goes on."""
    where = f"step {step}" if step is not None else "the end of the run"
    sys.stderr.write(
        f"precision_tool: warning: dumping stopped at {where}"
        f"{' of ' + run_dir if run_dir else ''}: {error}. The training goes on without a dump "
        f"(steps on disk: {layout.format_steps(on_disk) or 'none'}; {instead})\n")
    sys.stderr.flush()


def opdebug(op_name: str, op_type: str, task, timestamp: int, status: int, step: int) -> dict:
    """An overflowing task's Opdebug record (task: its task_id and stream_id)."""
    return {"op_name": op_name, "op_type": op_type, "task_id": task.task_id,
            "stream_id": task.stream_id, "timestamp": timestamp,
            "status": status, "status_hex": f"0x{status:x}",
            "status_bits": numerics.decode_status(status), "step": step}


def run_json(data) -> str:
    """The JSON text of a run-level file (and of an Opdebug record)."""
    return json.dumps(data, indent=1, sort_keys=False, default=str) + "\n"


class TensorSpec(NamedTuple):
    """A tensor as a device run's index describes it."""
    dtype: str
    format: str = "ND"
    original_shape: tuple = ()      # the shape before a format change (NC1HWC0)


class OpSpec(NamedTuple):
    """An op as a step's index names it: its type, its name, the tensors it reads
    (producer:k, with their specs) and its outputs' specs; pass_name: the fusion pass that
    made it."""
    type: str
    name: str
    inputs: tuple
    input_specs: tuple
    outputs: tuple
    pass_name: str = ""


def op_spec(graph, node) -> OpSpec:
    """A graph node's OpSpec (its input specs from the tensors it reads)."""
    def spec(s):
        return TensorSpec(s.dtype, s.format, tuple(s.original_shape or ()))
    return OpSpec(node.type, node.name, tuple(node.inputs),
                  tuple(spec(graph.tensor(t).spec) for t in node.inputs),
                  tuple(spec(s) for s in node.outputs), node.attrs.get("pass_name", ""))


class Record(NamedTuple):
    """One op of a step: its OpSpec, its input and output values (record[1] and record[2]:
    Row.side indexes them; inputs None, or an input None, where they are not written; a
    step's values all stepplan.Summary for a statistics dump that kept no copy), its
    task on a device (task_id and stream_id; None on a reference) and its timestamp."""
    op: OpSpec
    inputs: object
    outputs: list
    task: object
    timestamp: int


class _Static(NamedTuple):
    """An op's names and CSV fields, worked out once: its type and name as file names use
    them, quoted for the CSV, its pass, and per input and output (quoted tensor name, dtype,
    format, original shape, real channels of an NC1HWC0 tensor)."""
    type: str
    name: str
    q_type: str
    q_name: str
    q_pass: str
    ins: list
    outs: list


def _values_key(values) -> Optional[tuple]:
    """What of a record's values its index lines and files depend on."""
    return None if values is None else \
        tuple(None if v is None else (v.shape, v.dtype, isinstance(v, Spilled)) for v in values)


def _task_key(task) -> Optional[tuple]:
    return None if task is None else (task.task_id, task.stream_id)


def _dims(shape) -> str:
    return " ".join(map(str, shape))


class RunWriter:
    """A run being written (see the module). info: what run.json records beyond what every
    run has (writer, version, target, kind, start, dumped steps, versions): the graph's
    name, the configuration, the dump's settings. graph: a device run's compiled graph
    (graph.Graph, written as graph/<name>.json); fusion_result: its fusion record."""

    def __init__(self, root: str, target: layout.Target, info: Mapping, graph=None,
                 fusion_result: Optional[dict] = None, debug_dir: Optional[str] = None,
                 first_free: int = 0):
        self.target = target
        self.device = target.kind == layout.DEVICE
        try:
            self.run_dir = layout.next_debug_dir(os.path.join(root, target.name), debug_dir,
                                                 first_free)
        except OSError as e:        # a workspace under a file, a read-only disk...
            raise write_error(e) from None
        self.started = time.strftime("%Y%m%d%H%M%S")
        self.graph_name = graph.name if graph is not None else str(info.get("graph") or "graph")
        self.dumped_steps: List[int] = []
        self._handed: List[int] = []       # the steps queued to a writer thread
        self.history: List[list] = []      # step_history.csv rows of every observed step
        self._history_written = 0          # how many of them are in the file
        self.history_at = 0.0              # when they were last appended (time.monotonic)
        # by the whole OpSpec: a front-end may reuse a name for an op reading other tensors
        # (a script's Tensor.__getitem__.1 in two steps), and a name's cache would keep
        # the first step's inputs
        self._static: Dict[OpSpec, _Static] = {}
        self._last_plan: Optional[StepPlan] = None     # write_step's, for the next step
        self._spilled_step, self._spills = None, 0     # the step spill() writes into
        self._dirty = False                # run.json has facts not yet written (record)
        self._info = {"writer": "precision_tool", "version": __version__,
                      "target": target.name, "kind": target.kind, "started": self.started,
                      "device_id": 0, **info, "dumped_steps": [],
                      "versions": {"python": platform.python_version(),
                                   "numpy": np.__version__}}
        compiled = None
        if graph is not None:
            from ..graph import graph_to_json
            compiled = graph_to_json(graph) + "\n"
            # a reader that finds these bytes unchanged knows the graph well formed (it came
            # from a Graph) and skips the walk that checks a hand-edited or foreign one
            self._info["graph_sha1"] = hashlib.sha1(compiled.encode("utf-8")).hexdigest()
        try:
            write_text_atomic(os.path.join(self.run_dir, "run.json"), run_json(self._info))
            if compiled is not None:
                graphs = os.path.join(self.run_dir, "graph")
                os.makedirs(graphs, exist_ok=True)
                write_text_atomic(os.path.join(graphs, f"{layout.mangle(graph.name)}.json"),
                                  compiled)
            if fusion_result is not None:
                write_text_atomic(os.path.join(self.run_dir, "fusion_result.json"),
                                  run_json(fusion_result))
        except OSError as e:
            raise write_error(e) from None
        _announce(self.run_dir)

    def record(self, **facts) -> None:
        """More for run.json (what a front-end learns while the run goes: ops it did not
        simulate), written with the next finish()."""
        self._info.update(facts)
        self._dirty = True

    @property
    def info(self) -> dict:
        """What run.json holds (a copy)."""
        return dict(self._info)

    def steps_dir(self) -> str:
        """Where the step directories go, each named by its number (with the trailing
        separator): Ascend's dump/<time>/0/<graph>/0/ for a device run, dump/ for a
        reference."""
        if self.device:
            return os.path.join(self.run_dir, "dump", self.started, "0",
                                layout.mangle(self.graph_name), "0", "")
        return os.path.join(self.run_dir, "dump", "")

    # -- steps ---------------------------------------------------------------------------------
    def _statics(self, op: OpSpec) -> _Static:
        s = self._static.get(op)
        if s is None:
            def fields(tensor, spec):
                orig = _dims(spec.original_shape) if spec.original_shape else ""
                channels = spec.original_shape[1] if spec.format == "NC1HWC0" else 0
                return (csv_field(tensor), spec.dtype, spec.format, orig, channels)
            ins = [fields(t, spec) for t, spec in zip(op.inputs, op.input_specs)]
            outs = [fields(f"{op.name}:{k}", spec) for k, spec in enumerate(op.outputs)]
            # the real names: file names are mangled to fit by layout's name functions
            s = self._static[op] = _Static(op.type, op.name, csv_field(op.type),
                                                csv_field(op.name), csv_field(op.pass_name),
                                                ins, outs)
        return s

    def rows(self, records: Sequence[Record], mode: str) -> List[Row]:
        """The step's index lines, in order (see stepplan.Row). A tensor's later lines name
        the file of its first: a value several ops read is written once."""
        return self._device_rows(records, mode) if self.device else \
            self._reference_rows(records, mode)

    def _reference_rows(self, records, mode) -> List[Row]:
        # an op's outputs, then (but in "output" mode) its inputs, which name the file of the
        # op that made them: no file more, and the analysis sees what each op read (the
        # origin and cancellation checks need that of a golden run compared with another)
        rows = []
        inputs_too = mode != "output"
        for r, (op, inputs, outputs, _, _) in enumerate(records):
            st = self._statics(op)
            for k, (value, (q_tensor, _, _, _, _)) in enumerate(zip(outputs, st.outs)):
                # a reference holds every float in its own dtype: that is what it dumps
                rows.append(Row(r, 2, k, f"{op.name}:{k}", f"{st.q_type},{st.q_name},",
                                f",output,{k},{q_tensor},{value.dtype.name},{_dims(value.shape)}",
                                tuple(layout.cpu_file_name(st.name, k, STAMP).split(STAMP)),
                                value.dtype))
            if inputs_too and inputs:
                for k, (value, (q_tensor, _, _, _, _)) in enumerate(zip(inputs, st.ins)):
                    if value is None:
                        continue
                    producer, _, index = op.inputs[k].rpartition(":")
                    rows.append(Row(r, 1, k, op.inputs[k], f"{st.q_type},{st.q_name},",
                                    f",input,{k},{q_tensor},{value.dtype.name},"
                                    f"{_dims(value.shape)}",
                                    tuple(layout.cpu_file_name(producer, index, STAMP)
                                          .split(STAMP)), value.dtype))
        return rows

    def _device_rows(self, records, mode) -> List[Row]:
        rows = []
        sides = [side for side in ("input", "output") if mode in (side, "all")]
        for r, (op, inputs, outputs, task, _) in enumerate(records):
            t_name, n_name, q_type, q_name, q_pass, ins, outs = self._statics(op)
            before = f"{q_type},{q_name},{task.task_id},{task.stream_id},"
            for side in sides:
                values, specs = (inputs, ins) if side == "input" else (outputs, outs)
                for k, (v, (q_tensor, dtype, fmt, orig, channels)) in enumerate(zip(values or (), specs)):
                    if v is None:
                        continue
                    file = layout.npu_file_name(t_name, n_name, task.task_id, task.stream_id,
                                                STAMP, side, k).split(STAMP)
                    rows.append(Row(r, 1 if side == "input" else 2, k,
                                    op.inputs[k] if side == "input" else f"{op.name}:{k}",
                                    before, f",{side},{k},{q_tensor},{dtype},{fmt},"
                                            f"{_dims(v.shape)},{orig},{q_pass}",
                                    tuple(file), disk_dtype(v, dtype), channels))
        return rows

    def plan(self, key, records: Sequence[Record], mode: str, files: bool) -> StepPlan:
        """A StepPlan for steps like this one (key: what the caller reuses it by)."""
        rows = self.rows(records, mode)
        header = ",".join(NPU_COLUMNS if self.device else CPU_COLUMNS)
        return StepPlan(key, header, rows, [records[r.record][r.side][r.k] for r in rows], files)

    def _step_plan(self, records: Sequence[Record], mode: str, files: bool) -> StepPlan:
        """The last step's plan when this step's records are the same ops, tasks and value
        shapes and dtypes (a training loop's steps are), else a new one: its rows are the
        most of a small step's cost."""
        key = (mode, files, tuple((r.op, _task_key(r.task), _values_key(r.inputs),
                                   _values_key(r.outputs)) for r in records))
        if self._last_plan is None or self._last_plan.key != key:
            with collector_paused():    # thousands of rows and no cycles: see collector
                self._last_plan = self.plan(key, records, mode, files)
        return self._last_plan

    def partial_dir(self, number: int) -> str:
        """The hidden directory a step is written into before it is renamed into place."""
        return f"{self.steps_dir()}.{number}{PARTIAL}"

    def spill(self, number: int, value: np.ndarray) -> Spilled:
        """A value of step `number` written now, into the step's hidden directory (see
        stepplan.Spilled): a step so big that keeping a copy of each value until the step
        is written costs more than writing it at once. Such a step is written by
        write_step."""
        directory = os.path.join(self.partial_dir(number), SPILL_DIR)
        try:
            if self._spilled_step != number:
                os.makedirs(directory, exist_ok=True)
                self._spilled_step, self._spills = number, 0
            self._spills += 1
            return Spilled(os.path.join(directory, f"{self._spills}.npy"), value)
        except OSError as e:
            raise write_error(e) from None

    def drop_spilled(self) -> None:
        """The hidden directory of the step spill() last wrote into deleted, if it is still
        there: a step cut short, never written (a written step was renamed into place)."""
        if self._spilled_step is not None:
            shutil.rmtree(self.partial_dir(self._spilled_step), ignore_errors=True)
            self._spilled_step = None

    def write_step(self, number: int, records: Sequence[Record], mode: str = "all",
                   files: bool = True, calls: Optional[Mapping[str, dict]] = None) -> str:
        """Write a step here and now, whole or not at all: its index, (files) its tensor
        files and (calls) its ops' call sites (op name -> {"module", "source"}, calls.json);
        returns its directory. For values handed over once (an ONNX job's) and for steps
        too big to gain from a writer thread (a PyTorch tensor dump's); a training loop's
        other steps go to one (put_step)."""
        plan, filled, more, renames, dirs = self._step_job(number, records, mode, files, calls)
        try:
            plan.write(filled, more, renames=renames, dirs=dirs)
        except OSError as e:
            self.remove_partials()                  # never a step that looks begun
            raise write_error(e) from None
        self.written(number)
        return renames[0][1]

    def put_step(self, writer, number: int, records: Sequence[Record], mode: str = "all",
                 files: bool = True, calls: Optional[Mapping[str, dict]] = None) -> None:
        """write_step's step handed to a writer thread (dump.writer.make_writer's), which
        writes it while the training goes on: dumped_steps names it once it is on disk. A
        failure is raised by the writer's next put_step or flush (remove_partials then
        deletes what the step left)."""
        plan, filled, more, renames, dirs = self._step_job(number, records, mode, files, calls)
        if filled.spill_dir:
            raise ValueError("a step that spilled values is written by write_step")
        writer.put_step(plan, filled, more, (), renames, dirs, lambda: self.written(number))
        self.handed_over(number)

    def _step_job(self, number, records, mode, files, calls) -> tuple:
        """What writing a step takes: its plan, the plan filled with its values, its other
        files ((path, bytes) each), the rename that puts it in place and the directory
        made first."""
        plan = self._step_plan(records, mode, files)
        stamps = [r.timestamp for r in records]
        partial, path = self.partial_dir(number), self.steps_dir() + str(number)
        values = plan.gather(records)
        if values and isinstance(values[0], Summary):       # statistics taken as it ran
            filled = plan.fill_stats(partial, stamps, np.array([v.stats for v in values]))
        else:
            filled = plan.fill(partial, stamps, values)
        # a device task that overflowed (a status word) gets its Opdebug record
        more = [(os.path.join(partial, layout.opdebug_file_name(r.task.task_id, r.task.stream_id,
                                                                r.timestamp)),
                 run_json(opdebug(r.op.name, r.op.type, r.task, r.timestamp, r.task.status,
                                  number)).encode("utf-8"))
                for r in records if getattr(r.task, "status", 0)]
        if calls:
            more.append((os.path.join(partial, layout.CALLS_FILE),
                         json.dumps(calls, ensure_ascii=False, sort_keys=True).encode("utf-8")))
        return plan, filled, more, [(partial, path)], [partial]

    def handed_over(self, number: int) -> None:
        """A step is queued to a writer thread (put_step's, or a caller's own)."""
        self._handed.append(number)

    def written(self, number: int) -> None:
        """A step is on disk: run.json's list names it from the next finish()."""
        bisect.insort(self.dumped_steps, number)

    def abandon(self, writer, step: Optional[int]) -> Optional[int]:
        """After a write failed: the writer's queue dropped (its steps after the failure
        are not written), the hidden directories of steps begun and not finished deleted (a
        full disk gets its space back, and nothing looks like a step), and the step the
        dump stopped at returned: the first handed over and not on disk, else `step`."""
        try:
            writer.flush()
        except OSError:             # the failure itself, said by the caller
            pass
        self.remove_partials()
        lost = [n for n in self._handed if n not in self.dumped_steps]
        return lost[0] if lost else step

    def remove_partials(self) -> None:
        """Delete the hidden directories of steps begun and not finished."""
        for partial in glob.glob(glob.escape(self.steps_dir()) + ".*" + PARTIAL):
            shutil.rmtree(partial, ignore_errors=True)

    # -- run-level files -----------------------------------------------------------------------
    def observed(self, step: int, status: int, loss_scale: Optional[tuple],
                 loss: Optional[float] = None) -> None:
        """A step the run went through (dumped or not): its history row, written later."""
        scale = [repr(loss_scale[0]), repr(loss_scale[1]), int(loss_scale[2])] \
            if loss_scale else ["", "", ""]
        self.history.append([step, status, *scale, "" if loss is None else repr(loss)])

    def finish(self) -> None:
        """The history rows observed so far, and run.json's list of dumped steps, on disk."""
        self.write_history()
        if self._info["dumped_steps"] != self.dumped_steps or self._dirty:
            self._info["dumped_steps"] = list(self.dumped_steps)
            self._dirty = False
            write_text_atomic(os.path.join(self.run_dir, "run.json"), run_json(self._info),
                              durable=False)

    def fusion(self, record: dict) -> None:
        """fusion_result.json rewritten (a script's run learns its fused calls as it goes)."""
        write_text_atomic(os.path.join(self.run_dir, "fusion_result.json"), run_json(record),
                          durable=False)

    def stopped(self, step: Optional[int], error: str) -> None:
        """run.json records that the dump stopped at `step` (a write failure) and why, with
        the steps that are on disk, and the history observed so far is written."""
        self._info["dump_stopped"] = {"step": step, "error": error}
        self._info["dumped_steps"] = list(self.dumped_steps)
        try:
            self.write_history()
        finally:
            write_text_atomic(os.path.join(self.run_dir, "run.json"), run_json(self._info),
                              durable=False)

    def write_history(self) -> None:
        """Append the rows observed since the last call (a named run's old history is
        replaced by the first). Called at most once a second while steps are written, and
        at close: a killed run loses a second of history at most (a torn last line is
        skipped by the reader); rewriting it all each step would grow with the run."""
        rows = self.history[self._history_written:]     # a snapshot: the main thread appends
        self.history_at = time.monotonic()
        if not rows:
            return
        path = os.path.join(self.run_dir, layout.HISTORY_FILE)
        try:
            with open(path, "a" if self._history_written else "w", encoding="utf-8",
                      newline="") as f:
                out = csv.writer(f, lineterminator="\n")
                if not self._history_written:
                    out.writerow(layout.HISTORY_HEADER.split(","))
                out.writerows(rows)
        except OSError as e:        # a write's own error names no file: say which
            self._history_written = 0      # the file may end torn: written whole next time
            raise OSError(e.errno, e.strerror, e.filename or path) from None
        self._history_written += len(rows)
