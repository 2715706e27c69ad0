"""Single-op replay: run the golden kernel in float64 on the NPU's own dumped inputs of an op,
and separate the op's own error (NPU output against that replay) from the error it inherited
(the replay against the golden output). A fused op replays the original ops it replaced,
taken from the step's replay bundle."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from ... import numerics
from ...dump import Workspace
from ...dump.workspace import Run
from ...errors import GraphFormatError, PrecisionToolError
from ...graph import GraphView, NodeView, split_tensor_name
from ...ops import registry
from ..comparing.engine import logical_tensor
from ..comparing.mapping import TensorMap
from ..comparing.metrics import compare_tensors

COMPILE_ATTRS = ("compute_dtype", "roles", "pass_name", "original_op_names", "output_sources",
                 "inserted_by", "original_tensor")


class ReplayOpError(PrecisionToolError, ValueError):
    """The op cannot be replayed (not dumped, inputs missing, no replay bundle for a fused op)."""


@dataclass
class OpReplay:
    op_name: str
    output: str                  # the tensor replayed (its golden name)
    own: dict                    # metrics: NPU output against the float64 replay
    inherited: Optional[dict]    # metrics: the float64 replay against the golden (None: no golden)
    npu_dtype: str
    replay_at_max: int = 0       # elements of the float64 replay at or beyond 65504

    @property
    def made_nonfinite(self) -> bool:
        """The op itself turned finite values into inf or nan, or (an fp16 output) clipped
        them at 65504: its NPU output holds more of them than the float64 replay on the
        same inputs. The metrics leave those elements out, so this decides on its own."""
        own = self.own
        more = own["NpuNanCount"] + own["NpuInfCount"] > own["GoldenNanCount"] + own["GoldenInfCount"]
        clipped = self.npu_dtype == "float16" and own["NpuAtFp16Max"] > self.replay_at_max
        return bool(more or clipped)

    @property
    def verdict(self) -> str:
        """'local' when the op's own error (against a float64 replay on its own inputs) is
        the larger part, or when it made inf, nan or 65504 of finite values; 'inherited' when
        the error its inputs brought is the larger; 'exact' when both are below 1e-7
        (relative Euclidean distance)."""
        if self.made_nonfinite:
            return "local"
        own = _err(self.own)
        inherited = _err(self.inherited) if self.inherited is not None else 0.0
        if max(own, inherited) < 1e-7:
            return "exact"
        return "local" if own >= inherited else "inherited"


def _err(metrics: dict) -> float:
    e = metrics["RelativeEuclideanDistance"]
    return float("inf") if e != e else e      # an undefined distance counts as large


def _kernel_attrs(attrs: dict, op_type: str) -> dict:
    op = registry.get(op_type)
    full = dict(op.attrs)
    full.update({k: v for k, v in attrs.items() if k not in COMPILE_ATTRS})
    return full


def _run(op_type: str, attrs: dict, inputs, ctx):
    result = registry.get(op_type).kernel(inputs, _kernel_attrs(attrs, op_type), ctx)
    return [np.asarray(r) for r in (result if isinstance(result, (list, tuple)) else [result])]


def replay_op(ws: Workspace, npu_run: Run, step: int, op_name: str,
              golden_run: Optional[Run] = None, output_index: int = 0) -> OpReplay:
    table = ws.index(npu_run, step)
    rows = table[table.op_name == op_name]
    if rows.empty:
        raise ReplayOpError(f"op {op_name!r} is not in the dump of step {step}")
    graph = ws.compiled_graph(npu_run)
    node = graph.get(op_name) if graph is not None else None
    if node is None:
        raise ReplayOpError(f"op {op_name!r} is not in the compiled graph of {npu_run.name}")
    tmap = TensorMap(graph)
    inputs = {}
    for r in rows[rows.io == "input"].itertuples(index=False):
        if not r.file:
            raise ReplayOpError(f"step {step} dumped statistics only: no inputs to replay")
        value = logical_tensor(ws.load(npu_run, step, r.file, r.shape), r.format, r.original_shape)
        inputs[int(r.index)] = value.astype(np.float64) if value.dtype.kind == "f" else value
    if len(inputs) != len(node.inputs):
        raise ReplayOpError(f"op {op_name!r}: {len(node.inputs)} inputs, {len(inputs)} dumped "
                            f"(dump with dump_mode='all' or 'input')")
    out_rows = rows[(rows.io == "output") & (rows["index"] == output_index)]
    if out_rows.empty:
        raise ReplayOpError(f"op {op_name!r} output {output_index} is not dumped")
    out_row = out_rows.iloc[0]
    npu_out = logical_tensor(ws.load(npu_run, step, out_row.file, out_row["shape"]),
                             out_row.format, out_row.original_shape)
    ctx = registry.KernelContext(np.float64, step, graph.seed)
    args = [inputs[k] for k in range(len(node.inputs))]
    attrs = node.attrs
    target = tmap.golden_tensor(f"{op_name}:{output_index}")
    if attrs.get("original_op_names"):
        replayed = _replay_fused(npu_run, step, node, args, tmap, ctx)[target]
    elif attrs.get("inserted_by"):
        replayed = args[0]                          # a Cast or TransData carries its value
    else:
        replayed = _run(node.type, attrs, args, ctx)[output_index]
    inherited = None
    if golden_run is not None and target:
        gold = ws.index(golden_run, step)
        match = gold[gold.tensor == target]
        if not match.empty:
            inherited = compare_tensors(replayed, ws.load(golden_run, step, match.iloc[0]["file"],
                                                           match.iloc[0]["shape"]))
    with np.errstate(invalid="ignore"):
        at_max = int(np.count_nonzero(np.abs(replayed) >= numerics.FP16_MAX))
    return OpReplay(op_name, target or "", compare_tensors(npu_out, replayed), inherited,
                    str(out_row["dtype"]), at_max)


def _replay_fused(npu_run: Run, step: int, node: NodeView, args, tmap: TensorMap,
                  ctx) -> Dict[str, np.ndarray]:
    """Evaluate the original ops a fused node replaced, from the step's original graph."""
    path = os.path.join(npu_run.path, "replay", str(step), "graph.json")
    from ...fileio import load_json
    data = load_json(path, ReplayOpError, "the step's replay graph (a fused op replays its "
                                          "original ops from it)")
    try:
        original = GraphView(data)
    except GraphFormatError as e:
        raise ReplayOpError(f"the step's replay graph {path} is broken: {e}") from None
    env = {}
    for value, tensor in zip(args, node.inputs):
        env[tmap.golden_tensor(tensor) or tensor] = value
    members = set(node.attrs["original_op_names"])
    for n in original:                           # the graph lists ops in a valid order
        if n.name not in members:
            continue
        ins = []
        for t in n.inputs:
            if t not in env:
                src = original.get(split_tensor_name(t)[0])
                if src is not None and src.type == "Const":
                    env[t] = _run("Const", src.attrs, [], ctx)[0]
                else:
                    raise ReplayOpError(f"fused op {node.name!r}: input {t} of {n.name} "
                                        f"is neither dumped nor a constant")
            ins.append(env[t])
        for k, out in enumerate(_run(n.type, n.attrs, ins, ctx)):
            env[f"{n.name}:{k}"] = out
    return env
