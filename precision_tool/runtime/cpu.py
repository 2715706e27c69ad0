"""The CPU golden executor: runs every op's reference kernel in the golden float dtype."""
from __future__ import annotations

from typing import Dict

import numpy as np

from ..errors import ExecutionError
from ..graph import dtypes, format_shape
from ..ops import registry
from ..ops.state_ops import initial_value
from .plan import ExecutionPlan, build_plan, read_source, run_plan, substituted


class CpuExecutor:
    target = "cpu"

    def __init__(self, graph, config):
        self.graph = graph
        self.float_dtype = np.dtype(config.golden_dtype)
        self._constants: Dict[str, np.ndarray] = {}
        self._substitute: Dict[str, dict] = {}     # this run's (Session.run's substitute)
        self.stats = None          # the last run's statistics, when asked (see run)

    def initial_variables(self) -> Dict[str, np.ndarray]:
        """Variables start from their float32 (declared-dtype) values, whatever the golden dtype,
        so that fp32 and fp64 golden runs start from the same numbers."""
        out = {}
        for n in self.graph.nodes:
            if n.type == "Variable":
                out[n.name] = self.cast_in(initial_value(n, self.graph.seed), n.outputs[0].dtype)
        return out

    def plan(self, fetch_tensors, fetch_nodes, fed) -> ExecutionPlan:
        return build_plan(self.graph, fetch_nodes, fetch_tensors, fed)

    def fetch(self, values, name: str) -> np.ndarray:
        return values[name]

    def run_dtype(self, dtype: str) -> np.dtype:
        """The numpy dtype a tensor of IR dtype `dtype` has on this executor."""
        return registry.KernelContext(self.float_dtype).resolve_dtype(dtype)

    def cast_in(self, value: np.ndarray, dtype: str) -> np.ndarray:
        """A value entering the graph as IR dtype `dtype`: rounded to that dtype first (an
        fp16 input holds fp16 numbers even in an fp32 golden run), then held as the run dtype."""
        value = np.asarray(value)
        if dtypes.is_float(dtype):
            value = value.astype(dtypes.to_numpy(dtype), copy=False)
        return value.astype(self.run_dtype(dtype), copy=False)

    def run(self, plan: ExecutionPlan, values: Dict[str, np.ndarray],
            variables: Dict[str, np.ndarray], step: int, trace=None,
            stats: bool = False, substitute=None) -> Dict[str, np.ndarray]:
        """Run the plan; trace: see run_plan; stats: fill the plan's StatsTable with every
        value's statistics as it is made (self.stats: the table, until the next run);
        substitute: see Session.run."""
        ctx = registry.KernelContext(self.float_dtype, step, self.graph.seed)
        self.stats = None
        self._substitute = substitute or {}
        if not stats:
            return run_plan(plan, values, variables,
                            lambda node: self._execute(node, values, variables, ctx), trace)
        table = plan.stats_table
        table.start(values, variables)

        def execute(node):
            outputs = self._execute(node, values, variables, ctx)
            if node.type == "Variable":         # its statistics: StatsTable.start
                return outputs
            if registry.get(node.type).constant:
                table.constant(node.name, outputs[0])
            else:
                table.passed(node.name, outputs)
            return outputs
        run_plan(plan, values, variables, execute, trace)
        self.stats = table.table
        return values

    def _execute(self, node, values, variables, ctx):
        source = read_source(node, values, variables)
        if source is not None:
            return source
        op = registry.get(node.type)
        if op.constant and node.name in self._constants:
            return [self._constants[node.name]]
        given = self._substitute.get(node.name)
        if given is not None:
            computed = None if len(given) == len(node.outputs) else self._compute(node, op, values, ctx)
            return substituted(computed, given, lambda k, v: self.cast_in(v, node.outputs[k].dtype))
        return self._compute(node, op, values, ctx)

    def _compute(self, node, op, values, ctx):
        inputs = [values[i] for i in node.inputs]
        if op.gated and len(inputs) > op.min_inputs:
            if not inputs[-1]:                  # gate closed: the variables keep their values
                return [inputs[pos] for pos in op.updates]
            inputs = inputs[:-1]
        try:
            result = op.kernel(inputs, node.attrs, ctx)
        except Exception as e:  # a kernel failure is reported against the op that failed
            raise ExecutionError(f"op {node.name!r} ({node.type}) failed: {e}") from e
        outputs = [np.asarray(r) for r in (result if isinstance(result, (list, tuple)) else [result])]
        self._check(node, outputs, ctx)
        if op.constant:
            self._constants[node.name] = outputs[0]
        return outputs

    @staticmethod
    def _check(node, outputs, ctx):
        """Kernels must honour their op's static rule; a mismatch is a bug, caught at its op."""
        if len(outputs) != len(node.outputs):
            raise ExecutionError(f"op {node.name!r} ({node.type}) produced {len(outputs)} outputs, "
                                 f"its rule declares {len(node.outputs)}")
        for k, (out, spec) in enumerate(zip(outputs, node.outputs)):
            want = ctx.resolve_dtype(spec.dtype)
            if not isinstance(out, np.ndarray) or out.dtype != want or out.ndim != len(spec.shape) \
                    or any(d is not None and d != s for d, s in zip(spec.shape, out.shape)):
                got = f"{getattr(out, 'dtype', type(out).__name__)}{list(np.shape(out))}"
                raise ExecutionError(f"op {node.name!r} ({node.type}) output {k} is {got}, "
                                     f"expected {want}{format_shape(spec.shape)}")
