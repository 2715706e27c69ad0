"""The simulated NPU's compile pipeline:

    graph fusion -> precision policy -> Cast insertion -> TransData (5HD) insertion -> UB fusion

Graph fusion comes first so that its patterns see the graph as written (the casts a policy
inserts would otherwise break them); UB fusion comes last because it fuses kernels of one
compute dtype and format. In pynative mode only the policy and the casts apply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from ... import numerics
from ...graph import NOT_KERNELS, Graph, TensorSpec, dtypes, graph_from_dict, graph_to_dict
from ...ops import registry
from . import fusion
from .policy import FIXED, Policy
from ...ops.registry import KEEP_DTYPE

_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
FORMAT_TRANSPARENT = frozenset({"Cast", "Relu"})   # f(0) = 0: a 5HD input stays 5HD


@dataclass
class CompiledGraph:
    graph: Graph
    tensor_map: Dict[str, str]            # original tensor -> compiled tensor (absent: fused away)
    fused_away: Dict[str, str]            # original op -> the fused node that absorbed it
    fusion: Dict[str, fusion.PassCounts]  # per pass that ran
    task_ids: Dict[str, int]              # compiled kernel node -> task id


def compile_graph(source: Graph, policy: Policy, passes: List[str], graph_mode: bool) -> CompiledGraph:
    g = graph_from_dict(graph_to_dict(source))            # a private copy to rewrite
    counts: Dict[str, fusion.PassCounts] = {}
    if graph_mode:
        fusion.run_passes(g, passes, fusion.GRAPH, counts)
    _assign_dtypes(g, policy)
    _insert_casts(g)
    if graph_mode:
        _insert_trans_data(g)
        fusion.run_passes(g, passes, fusion.UB, counts)
    tensor_map, fused_away = _map_tensors(source, g)
    kernels = [n.name for n in g.topological_order() if n.type not in NOT_KERNELS]
    return CompiledGraph(g, tensor_map, fused_away, counts,
                         {name: k for k, name in enumerate(kernels, 1)})


def _float_inputs(node, op):
    gate = len(node.inputs) - 1 if op.gated and len(node.inputs) > op.min_inputs else None
    for pos, t in enumerate(node.inputs):
        if pos in op.shape_inputs or pos == gate:
            continue
        if dtypes.is_float(node.graph.tensor(t).dtype):
            yield pos, t


def _assign_dtypes(g: Graph, policy: Policy):
    for node in g.topological_order():
        if node.type in FIXED:
            continue
        op = registry.get(node.type)
        float_outs = [s for s in node.outputs if dtypes.is_float(s.dtype)]
        inputs = list(_float_inputs(node, op))
        if not float_outs and not inputs:
            continue
        declared = (float_outs or [g.tensor(t).spec for _, t in inputs])[0].dtype
        votes = [g.tensor(t).dtype for _, t in inputs           # parameters do not vote
                 if g.node(t.rpartition(":")[0]).type not in ("Variable", "Const")]
        # state updates, and ops marked keep_dtype (loss-scale bookkeeping), keep their dtype
        keep = bool(op.updates) or bool(node.attrs.get(KEEP_DTYPE))
        d = policy.decide(node.type, declared, votes, op.unit == registry.CUBE, keep)
        node.attrs["compute_dtype"] = d["compute"]
        node.outputs = [s.with_dtype(d["output"]) if dtypes.is_float(s.dtype) else s
                        for s in node.outputs]


def _fresh(g: Graph, name: str) -> str:
    k, candidate = 0, name
    while candidate in g:
        k += 1
        candidate = f"{name}_{k}"
    return candidate


def _insert_casts(g: Graph):
    made: Dict[tuple, str] = {}
    for node in g.topological_order():
        if node.type in FIXED:
            continue
        op = registry.get(node.type)
        want = node.attrs.get("compute_dtype")
        if want is None:
            continue
        for pos, t in _float_inputs(node, op):
            spec = g.tensor(t).spec
            if spec.dtype == want:
                continue
            key = (t, want)
            if key not in made:
                src, index = t.rpartition(":")[0], int(t.rpartition(":")[2])
                suffix = f"Cast_{_SHORT.get(want, want)}" + (f"_out{index}" if index else "")
                name = _fresh(g, f"{src}/{suffix}")
                g.insert_node(name, "Cast", [t], {"dtype": want, "compute_dtype": want,
                                                  "inserted_by": "precision policy",
                                                  "original_tensor": t}, [spec.with_dtype(want)])
                made[key] = f"{name}:0"
            node.inputs[pos] = made[key]


def _is_nchw(spec: TensorSpec) -> bool:
    return len(spec.logical_shape) == 4 and None not in spec.logical_shape[1:]


def _trans_data(g: Graph, t: str, dst: str, made: Dict) -> str:
    key = (t, dst)
    if key not in made:
        spec = g.tensor(t).spec
        src_node = t.rpartition(":")[0]
        index = int(t.rpartition(":")[2])
        name = _fresh(g, f"{src_node}/TransData_{'5HD' if dst == 'NC1HWC0' else 'ND'}"
                      + (f"_out{index}" if index else ""))
        if dst == "NC1HWC0":
            out = TensorSpec(five_hd(spec.shape), spec.dtype, "NC1HWC0", spec.shape)
        else:
            out = TensorSpec(spec.logical_shape, spec.dtype)
        g.insert_node(name, "TransData", [t], {"src_format": spec.format, "dst_format": dst,
                                               "original_shape": list(spec.logical_shape),
                                               "inserted_by": "format"}, [out])
        made[key] = f"{name}:0"
    return made[key]


def five_hd(shape):
    return (shape[0],) + numerics.five_hd_shape((1,) + tuple(shape[1:]))[1:]


def _insert_trans_data(g: Graph):
    made: Dict = {}
    for node in g.topological_order():
        if node.type == "TransData":
            continue
        op = registry.get(node.type)
        ins5, outs5 = op.five_hd
        if node.type in FORMAT_TRANSPARENT and node.inputs and \
                g.tensor(node.inputs[0]).spec.format == "NC1HWC0":
            ins5, outs5 = (0,), (0,)
        for pos, t in enumerate(node.inputs):
            spec = g.tensor(t).spec
            if pos in ins5 and spec.format == "ND" and _is_nchw(spec):
                node.inputs[pos] = _trans_data(g, t, "NC1HWC0", made)
            elif pos not in ins5 and spec.format == "NC1HWC0":
                node.inputs[pos] = _trans_data(g, t, "ND", made)
        node.outputs = [TensorSpec(five_hd(s.shape), s.dtype, "NC1HWC0", s.shape)
                        if k in outs5 and s.format == "ND" and _is_nchw(s) else s
                        for k, s in enumerate(node.outputs)]


def _map_tensors(source: Graph, g: Graph):
    tensor_map, fused_away = {}, {}
    for node in g.nodes:
        for k, t in enumerate(node.attrs.get("output_sources", [])):
            tensor_map[t] = f"{node.name}:{k}"
        for original in node.attrs.get("original_op_names", []):
            fused_away[original] = node.name
    for node in source.nodes:
        if node.name in g and not g.node(node.name).attrs.get("pass_name"):
            for k in range(len(node.outputs)):
                tensor_map.setdefault(f"{node.name}:{k}", f"{node.name}:{k}")
            fused_away.pop(node.name, None)
    return tensor_map, fused_away
