"""Builds a one-op graph for a test case and runs it through the public API; dumps one run of
a graph on both targets; writes a tensor into a dump as the dump would have recorded it."""
import csv
import os

import numpy as np

import precision_tool as pt
from precision_tool.ops import registry


def build(case, float_dtype=None):
    """Graph with one placeholder (or variable, where the op updates it) per input; float
    inputs are declared as `float_dtype` when given (float64 for finite differences)."""
    g = pt.Graph(case.name.replace("-", "_"), seed=7)
    op = registry.get(case.op)
    feeds, variables, inputs = {}, {}, []
    with g.as_default():
        for k, (value, dtype) in enumerate(zip(case.inputs, case.input_dtypes())):
            if float_dtype and value.dtype.kind == "f":
                dtype = float_dtype
            if k in op.updates:
                t = pt.variable(f"v{k}", list(value.shape), init="zeros", dtype=dtype)
                variables[t.node.name] = value
            else:
                t = pt.placeholder(f"in{k}", list(value.shape), dtype)
                feeds[t] = value
            inputs.append(t)
        node = registry.make(case.op, inputs, case.attrs)
    return g, node, inputs, feeds, variables


def run(case, golden_dtype="float64"):
    g, node, inputs, feeds, variables = build(case)
    sess = pt.Session(g, config=pt.SessionConfig(golden_dtype=golden_dtype))
    sess.load_variables(variables)
    fetches = [node.output(k) for k in range(len(node.outputs))]
    return sess.run(fetches, feeds), sess


def as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def round_inputs(case):
    """The inputs as a run sees them: float inputs rounded to their declared dtype first."""
    from precision_tool.graph import dtypes
    return [v.astype(dtypes.to_numpy(d)).astype(np.float64) if v.dtype.kind == "f" else v
            for v, d in zip(case.inputs, case.input_dtypes())]


def dump_both(root, graph, fetches, feeds, config=None):
    """One run of the graph on the simulated NPU (config) and on the golden executor, both
    dumped into the workspace at root."""
    from precision_tool import hooks
    npu = pt.Session(graph, target="npu", config=hooks.session_dump_config(
        config or pt.SessionConfig(), action="dump", data_dir=root))
    cpu = hooks.sess_dump(pt.Session(graph), action="dump", data_dir=root)
    for sess in (npu, cpu):
        sess.run(fetches, feeds)
        sess.close()


def recorded_as(step_dir, file, value):
    """The index row of `file` saying the nan/inf counts of `value`, as a dump of it would
    (a file whose counts differ from its row's is damage: not compared)."""
    path = os.path.join(step_dir, "index.csv")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = rows[0]
    for r in rows[1:]:
        if r[head.index("file")] == file:
            r[head.index("nan_count")] = str(int(np.isnan(value).sum()))
            r[head.index("pos_inf_count")] = str(int(np.isposinf(value).sum()))
            r[head.index("neg_inf_count")] = str(int(np.isneginf(value).sum()))
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
