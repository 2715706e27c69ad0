"""The simulated NPU executor: runs a compiled graph with NPU numerics.

Low-precision (fp16/bf16) tensors are held as float32 arrays whose values lie on the fp16/bf16
grid (numerics.quantize, bit-identical to a round trip through the real dtype); fetches and
dumps give them in their real dtype. Every kernel computes with the op's reference kernel in
fp32 — for cube ops that is fp32 BLAS on fp16/bf16-valued operands, i.e. fp32 accumulation of
exact products — and each output is rounded to its compiled dtype.
Overflow follows `overflow_mode`: "saturation" (+-inf -> +-max, nan -> 0; only the status
word shows it) or "inf_nan" (IEEE). Each kernel is a task with an id, a stream, a timestamp
and an AI Core status word:
  0x20  a result overflowed its dtype (or became inf/nan from finite inputs)
  0x100 an fp32 -> fp16/bf16 Cast overflowed
  0x400 the cube unit's fp32 accumulator overflowed
  0x80  a float -> integer Cast was out of range
(0x8 and 0x10, the integer overflow and divide-by-zero bits, are defined in numerics; no op
of our set raises them.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

import numpy as np

from ... import kernels, numerics
from ...errors import ExecutionError, FetchError, PrecisionToolError
from ...graph import dtypes
from ...ops import registry
from ...ops.state_ops import initial_value
from ..plan import ExecutionPlan, build_plan, read_source, run_plan, substituted
from .compiler import FORMAT_TRANSPARENT, CompiledGraph, compile_graph
from .fusion import enabled_passes
from .policy import make_policy

F32 = np.dtype(np.float32)


class DeviceMemoryError(PrecisionToolError, MemoryError):
    """The step's tensors do not fit the simulated device memory."""


class Task(NamedTuple):
    """One executed kernel, as the NPU's profiling and dump records name it (a named tuple:
    a step makes hundreds, and a frozen dataclass costs three times as much to make)."""
    name: str
    type: str
    task_id: int
    stream_id: int
    timestamp: int          # microseconds since the epoch, at launch
    status: int             # AI Core status word


@dataclass
class _Step:
    """Everything about one compiled node that does not change between runs."""
    node: object
    op: registry.OpDef
    inputs: List[str]
    from_5hd: List[int]           # inputs to convert NC1HWC0 -> NCHW before the kernel
    out_dtypes: List[str]         # IR dtypes of the outputs
    to_5hd: List[int]             # outputs to convert NCHW -> NC1HWC0 after the kernel
    low: Optional[str]            # "float16"/"bfloat16" when the op computes below fp32
    task_id: int
    cast_to: Optional[str]        # Cast nodes: the executor converts itself
    is_cube: bool
    gated: bool
    # (output, real channels) of the outputs stored in NC1HWC0, whatever made them: their
    # statistics leave the padding out (numerics.logical_view)
    five_hd: List[tuple] = ()


LOW = ("float16", "bfloat16")


def _np(dtype: str) -> np.dtype:
    return dtypes.to_numpy(dtype)


def _storage(dtype: str) -> np.dtype:
    """How the executor holds a tensor of IR dtype `dtype`: fp16/bf16 as float32."""
    return F32 if dtype in LOW else dtypes.to_numpy(dtype)


class NpuExecutor:
    target = "npu"

    def __init__(self, graph, config):
        self.source = graph
        self.config = config
        graph_mode = config.mode == "graph"
        policy = make_policy(config.precision_mode, config.amp_level, config.modify_mixlist)
        passes = enabled_passes(config.fusion_switch_spec) if graph_mode else []
        self.compiled: CompiledGraph = compile_graph(graph, policy, passes, graph_mode)
        self.graph = self.compiled.graph
        self.saturation = config.overflow_mode == "saturation"
        self._grid = kernels.rounder()       # made again each run: see run()
        self._steps: Dict[str, _Step] = {}
        self._constants: Dict[str, np.ndarray] = {}
        self._substitute: Dict[str, dict] = {}     # this run's (Session.run's substitute)
        self._memory_checked = set()     # (plan, batch size) pairs that fit
        self.tasks: List[Task] = []
        self._ctx = None                 # the last run's kernel context (see status)
        self.stats: Optional[np.ndarray] = None

    # -- the Session's side ---------------------------------------------------------------
    def initial_variables(self) -> Dict[str, np.ndarray]:
        return {n.name: self.cast_in(initial_value(n, self.graph.seed), n.outputs[0].dtype)
                for n in self.graph.nodes if n.type == "Variable"}

    def run_dtype(self, dtype: str) -> np.dtype:
        return _storage(dtype)

    def cast_in(self, value, dtype: str) -> np.ndarray:
        """Round to the declared dtype (once, from whatever precision it comes in), hold as stored."""
        return np.asarray(value).astype(_np(dtype), copy=False).astype(_storage(dtype), copy=False)

    def plan(self, fetch_tensors, fetch_nodes, fed) -> ExecutionPlan:
        tensors = [self._compiled_tensor(t) for t in fetch_tensors]
        nodes = []
        for name in fetch_nodes:
            if name not in self.graph:
                raise FetchError(self._fused_message(name))
            nodes.append(name)
        return build_plan(self.graph, nodes, tensors, fed)

    def fetch(self, values, name: str) -> np.ndarray:
        """A fetched tensor as the user's graph declares it: logical format, declared dtype."""
        compiled = self._compiled_tensor(name)
        value = values[compiled]
        spec = self.graph.tensor(compiled).spec
        if spec.format == "NC1HWC0":
            value = numerics.five_hd_to_nchw(value, (value.shape[0],) + tuple(spec.original_shape[1:]))
        declared = self.source.tensor(name).dtype
        return value.astype(_np(declared))

    def _compiled_tensor(self, name: str) -> str:
        try:
            return self.compiled.tensor_map[name]
        except KeyError:
            raise FetchError(self._fused_message(name.rpartition(":")[0], name)) from None

    def _fused_message(self, op_name: str, what: Optional[str] = None) -> str:
        fused = self.compiled.fused_away.get(op_name)
        if fused is None:
            return f"{what or op_name!r} does not exist on the compiled NPU graph"
        node = self.graph.node(fused)
        return (f"{what or op_name!r} was fused into {fused!r} by {node.attrs['pass_name']} and "
                f"is not an output of it; switch the pass off to fetch it")

    # -- running --------------------------------------------------------------------------
    def run(self, plan: ExecutionPlan, values, variables, step: int, trace=None,
            stats: bool = False, substitute=None):
        """Run the plan; trace: see run_plan; stats: fill the plan's StatsTable with every
        value's statistics, each result's in its rounding pass (self.stats: the table, until
        the next run); substitute: see Session.run."""
        self._substitute = substitute or {}
        self._check_memory(plan, values, variables)
        ctx = registry.KernelContext(F32, step, self.graph.seed, self.saturation, device=True)
        self._grid = kernels.rounder()       # chosen once a run: it reads the environment
        tasks: List[Task] = []
        self.tasks, self._ctx = tasks, ctx
        table = plan.stats_table if stats else None
        if table is not None:
            table.start(values, variables)
        run_plan(plan, values, variables,
                 lambda node: self._execute(node, values, variables, ctx, tasks, table), trace)
        self.stats = None if table is None else table.table
        return values

    @property
    def status(self) -> int:
        """The OR of the status words of the last run's tasks (so far, if it failed)."""
        return 0 if self._ctx is None else self._ctx.run_status

    def _execute(self, node, values, variables, ctx, tasks, table):
        source = read_source(node, values, variables)
        if source is not None:          # its statistics: StatsTable.start
            return source
        t = node.type
        if t == "Const":
            if node.name not in self._constants:
                c = registry.get("Const").kernel([], node.attrs, ctx)
                self._constants[node.name] = self.cast_in(c, node.outputs[0].dtype)
            if table is not None:
                table.constant(node.name, self._constants[node.name])
            return [self._constants[node.name]]
        step = self._steps.get(node.name) or self._prepare(node)
        launched = int(time.time() * 1e6)
        given = self._substitute.get(node.name)
        if given is not None and len(given) == len(node.outputs):
            # what-if: the given values, and no status word of its own
            outputs = substituted(None, given, self._stored(node))
            if step.task_id:
                tasks.append(Task(node.name, t, step.task_id, 0, launched, 0))
            if table is not None:
                table.passed(node.name, outputs)
            return outputs
        inputs = [values[i] for i in step.inputs]
        if step.gated and len(inputs) > step.op.min_inputs:
            if not inputs[-1]:
                if step.task_id:
                    tasks.append(Task(node.name, t, step.task_id, 0, launched, 0))
                outputs = [inputs[pos] for pos in step.op.updates]
                if table is not None:
                    table.passed(node.name, outputs)
                return outputs
            inputs = inputs[:-1]
        ctx.status = 0
        rows = None if table is None else table.rows[node.name]
        if step.cast_to is not None:
            outputs = [self._cast(inputs[0], step.cast_to, ctx, None if rows is None else rows[0])]
        else:
            outputs = self._compute(step, inputs, ctx, rows)
        if given is not None:                        # some outputs given: as if it did right
            outputs = substituted(outputs, given, self._stored(node))
            ctx.status = 0
            if table is not None:
                table.passed(node.name, outputs)
        elif rows is not None:
            for k, channels in step.five_hd:         # the real values' statistics
                kernels.stats_row(numerics.logical_view(outputs[k], channels), rows[k])
                rows[k][7] = float(outputs[k].size)  # the size the dump's plan checks
        if step.task_id:
            tasks.append(Task(node.name, t, step.task_id, 0, launched, ctx.status))
            if ctx.status:
                ctx.float_status |= ctx.status
                ctx.run_status |= ctx.status
        return outputs

    def _stored(self, node):
        """(output, logical value) -> the value as this executor holds that output: rounded
        to its dtype, in NC1HWC0 where it is stored so."""
        def store(k, value):
            spec = node.outputs[k]
            value = self.cast_in(value, spec.dtype)
            if spec.format == "NC1HWC0":
                value = numerics.nchw_to_5hd(value)
            return value
        return store

    def _prepare(self, node) -> _Step:
        op = registry.get(node.type)
        specs = [self.graph.tensor(i).spec for i in node.inputs]
        ins5, outs5 = op.five_hd
        # these read and write whatever format they are given (TransData converts itself)
        transparent = node.type in FORMAT_TRANSPARENT or node.type == "TransData"
        compute = node.attrs.get("compute_dtype")
        step = _Step(
            node=node, op=op, inputs=list(node.inputs),
            from_5hd=[k for k, s in enumerate(specs) if s.format == "NC1HWC0" and not transparent],
            out_dtypes=[s.dtype for s in node.outputs],
            to_5hd=[k for k, s in enumerate(node.outputs) if s.format == "NC1HWC0" and not transparent],
            low=compute if compute in LOW else None,
            task_id=self.compiled.task_ids.get(node.name, 0),
            cast_to=node.attrs["dtype"] if node.type == "Cast" else None,
            is_cube=op.unit == registry.CUBE,
            gated=op.gated,
            five_hd=[(k, s.original_shape[1]) for k, s in enumerate(node.outputs)
                     if s.format == "NC1HWC0"])
        self._steps[node.name] = step
        return step

    def _compute(self, step: _Step, inputs, ctx, rows=None):
        for k in step.from_5hd:
            x = inputs[k]
            spec = self.graph.tensor(step.inputs[k]).spec
            inputs[k] = numerics.five_hd_to_nchw(x, (x.shape[0],) + tuple(spec.original_shape[1:]))
        ctx.low = step.low
        ctx.kernel_inputs = inputs
        node = step.node
        try:
            result = step.op.kernel(inputs, node.attrs, ctx)
        except Exception as e:  # a kernel failure is reported against the op that failed
            raise ExecutionError(f"op {node.name!r} ({node.type}) failed: {e}") from e
        raw = [np.asarray(r) for r in (result if isinstance(result, (list, tuple)) else [result])]
        if len(raw) != len(step.out_dtypes):
            raise ExecutionError(f"op {node.name!r} ({node.type}) produced {len(raw)} outputs, "
                                 f"its compiled node declares {len(step.out_dtypes)}")
        outputs = []
        for k, (r, dt) in enumerate(zip(raw, step.out_dtypes)):
            row = None if rows is None else rows[k]
            if k in step.to_5hd:        # its statistics: _execute, over the real values
                out = numerics.nchw_to_5hd(self._round(r, dt, inputs, ctx, step.is_cube))
            else:
                out = self._round(r, dt, inputs, ctx, step.is_cube, row)
            outputs.append(out)
        return outputs

    def _round(self, r, dtype: str, inputs, ctx, is_cube, row=None):
        """Round a kernel result to its output dtype; status and saturation as the hardware.
        row: where the rounded value's statistics go (kernels.stats_row), or None."""
        if dtype not in dtypes.FLOAT_DTYPES:
            out = r.astype(_np(dtype), copy=False)
            if row is not None:
                kernels.stats_row(out, row)
            return out
        r = r.astype(F32, copy=False)
        out, overflowed = self._grid(r, dtype, self.saturation, row)
        if overflowed and registry.all_finite(inputs):      # born here, not carried in
            raw_bad = not np.isfinite(r).all()
            ctx.status |= (numerics.STATUS_CUBE_OVERFLOW if raw_bad and is_cube
                           else numerics.STATUS_FLOAT_OVERFLOW)
        return out

    def _cast(self, x, dtype: str, ctx, row=None):
        if dtype not in dtypes.FLOAT_DTYPES:
            target = _np(dtype)
            if target.kind in "iu" and x.dtype.kind == "f":
                info = np.iinfo(target)
                if x.size and (not np.isfinite(x).all() or x.min() < info.min or x.max() > info.max):
                    ctx.status |= numerics.STATUS_FLOAT_TO_INT
                out = x.astype(np.float64).astype(target)
            else:
                out = x.astype(target)
            if row is not None:
                kernels.stats_row(out, row)
            return out
        x = x.astype(F32, copy=False)
        out, overflowed = self._grid(x, dtype, self.saturation, row)
        if overflowed and np.isfinite(x).all():
            ctx.status |= numerics.STATUS_CAST_OVERFLOW
        return out

    def _check_memory(self, plan: ExecutionPlan, values, variables):
        """Like a real device, refuse a step whose tensors (all of them, no reuse: an upper
        bound) exceed device memory, before running anything."""
        limit = self.config.device_memory
        batch = max([v.shape[0] for v in values.values() if getattr(v, "ndim", 0)] or [1])
        if (id(plan), batch) in self._memory_checked:
            return
        activations = 0
        for node in plan.nodes:
            if node.type == "Variable":
                continue
            for s in node.outputs:
                n = 1
                for d in s.shape:
                    n *= batch if d is None else d
                activations += n * _np(s.dtype).itemsize     # the device holds the real dtype
        weights = sum(v.nbytes for v in variables.values())
        if activations + weights > limit:
            gib = 2 ** 30
            raise DeviceMemoryError(
                f"out of device memory: the step needs {(activations + weights) / gib:.2f} GiB "
                f"({activations / gib:.2f} GiB of tensors, {weights / gib:.2f} GiB of variables), "
                f"the device has {limit / gib:.2f} GiB")
        self._memory_checked.add((id(plan), batch))
