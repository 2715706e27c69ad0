"""Fusion passes of the simulated NPU compiler, and Ascend's fusion_switch.cfg.

A pass is a small unit: a `match` that recognises its pattern at an anchor op and returns
the fused op to build; the fused op's kernel (ops/fused_ops.py) states its numerics. The
framework rewires the graph: the fused node takes the name of the pattern's result op and
records `pass_name`, `original_op_names` and, for each output, the original tensor it stands
for (`output_sources`). A pattern tensor that other ops still read is exposed as an extra
output (a *role*) of the fused node.

Graph-fusion passes run on the original graph before the precision policy; UB-fusion passes
run last, on the graph with its dtypes, casts and formats, and fuse only ops that share a
compute dtype and format.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from ...errors import PrecisionToolError
from ...fileio import load_json
from ...graph import Graph
from ...graph.ir import Node

GRAPH, UB = "GraphFusion", "UBFusion"


class FusionSwitchError(PrecisionToolError, ValueError):
    """A fusion switch that cannot be used (malformed file, unknown pass)."""


@dataclass
class Match:
    nodes: List[Node]              # the pattern, in topological order; the last is its result
    inputs: List[str]              # tensors the fused op reads
    type: str
    attrs: Dict
    roles: Dict[str, str]          # role -> original tensor; the first role is the result


@dataclass(frozen=True)
class FusionPass:
    name: str
    kind: str
    match: Callable[[Graph, Node, Dict], Optional[Match]]
    doc: str = ""


PASSES: Dict[str, FusionPass] = {}


def fusion_pass(name: str, kind: str):
    def deco(fn):
        PASSES[name] = FusionPass(name, kind, fn, (fn.__doc__ or "").strip())
        return fn
    return deco


# -- the switch file -------------------------------------------------------------------------
def enabled_passes(switch) -> List[str]:
    """Names of the passes that run. `switch`: None or "on" (all), "off" (none), a dict in
    fusion_switch.cfg form, or the path of such a file:
    {"Switch": {"GraphFusion": {"ALL": "off", "MatMulBiasAddFusionPass": "on"}, "UBFusion": {...}}}"""
    if switch is None or switch == "on":
        return list(PASSES)
    if switch == "off":
        return []
    if isinstance(switch, (str, os.PathLike)):
        switch = load_json(switch, FusionSwitchError, "fusion switch file")
    if not isinstance(switch, dict) or not isinstance(switch.get("Switch"), dict):
        raise FusionSwitchError('fusion switch must be {"Switch": {"GraphFusion": {...}, '
                                '"UBFusion": {...}}}')
    sections = switch["Switch"]
    unknown_sections = set(sections) - {GRAPH, UB}
    if unknown_sections:
        raise FusionSwitchError(f"fusion switch: unknown section(s) {sorted(unknown_sections)}; "
                                f"expected {GRAPH} and {UB}")
    enabled = []
    for kind in (GRAPH, UB):
        entries = sections.get(kind, {})
        if not isinstance(entries, dict):
            raise FusionSwitchError(f"fusion switch: {kind} must be an object of \"Pass\": \"on|off\"")
        states = {}
        for key, value in entries.items():
            if not isinstance(value, str) or value.lower() not in ("on", "off"):
                raise FusionSwitchError(f"fusion switch: {kind}.{key} must be \"on\" or \"off\", "
                                        f"got {value!r}")
            if key != "ALL" and (key not in PASSES or PASSES[key].kind != kind):
                known = ", ".join(n for n, p in PASSES.items() if p.kind == kind)
                raise FusionSwitchError(f"fusion switch: unknown {kind} pass {key!r}; known: {known}")
            states[key] = value.lower() == "on"
        default = states.get("ALL", True)
        enabled += [n for n, p in PASSES.items() if p.kind == kind and states.get(n, default)]
    return enabled


def switch_for(passes_on) -> dict:
    """fusion_switch.cfg content with exactly `passes_on` switched on (what a replay, a
    bisection or a saved config writes)."""
    return {"Switch": {kind: dict([("ALL", "off")] + [(p, "on") for p, d in PASSES.items()
                                                      if d.kind == kind and p in passes_on])
                       for kind in (GRAPH, UB)}}


# -- the framework ---------------------------------------------------------------------------
@dataclass
class PassCounts:
    match_times: int = 0
    effect_times: int = 0
    fused_nodes: List[str] = field(default_factory=list)


def fusion_record(graph_name: str, counts: Dict[str, "PassCounts | set"]) -> dict:
    """fusion_result.json's content, in the shape of Ascend's: per pass that ran, its match
    and effect counts and the fused nodes. counts: PassCounts, or the set of nodes a pass
    fused (a script's calls, each a match with an effect)."""
    out = {"graph_fusion": {}, "ub_fusion": {}}
    for name, c in counts.items():
        if not isinstance(c, PassCounts):
            c = PassCounts(len(c), len(c), sorted(c))
        kind = "graph_fusion" if PASSES[name].kind == GRAPH else "ub_fusion"
        out[kind][name] = {"match_times": c.match_times, "effect_times": c.effect_times,
                           "fused_nodes": list(c.fused_nodes)}
    return {graph_name: out}


def run_passes(graph: Graph, names: List[str], kind: str, counts: Dict[str, PassCounts]):
    for name in names:
        p = PASSES[name]
        if p.kind != kind:
            continue
        c = counts.setdefault(name, PassCounts())
        consumers = graph.consumers()
        for node in graph.topological_order():
            if node.name not in graph or node.attrs.get("pass_name"):
                continue
            m = p.match(graph, node, consumers)
            if m is None:
                continue
            c.match_times += 1
            fused = _fuse(graph, m, p.name, consumers)
            if fused is not None:
                c.effect_times += 1
                c.fused_nodes.append(fused)
                consumers = graph.consumers()


def _fuse(graph: Graph, m: Match, pass_name: str, consumers) -> Optional[str]:
    members = {n.name for n in m.nodes}
    if any(graph.node(n).attrs.get("pass_name") for n in members):
        return None
    role_of = {tensor: role for role, tensor in m.roles.items()}
    result_role = next(iter(m.roles))
    exposed = [result_role]
    for n in m.nodes:
        for k in range(len(n.outputs)):
            t = f"{n.name}:{k}"
            outside = [c for c, _ in consumers.get(t, []) if c.name not in members]
            if not outside:
                continue
            if t not in role_of:
                return None               # read outside, and the fused kernel cannot expose it
            if role_of[t] not in exposed:
                exposed.append(role_of[t])
    if _reaches(graph, m.inputs, members):
        return None                       # an input depends on the pattern: fusing makes a cycle
    name = m.nodes[-1].name
    sources = [m.roles[r] for r in exposed]
    specs = [graph.tensor(t).spec for t in sources]
    rename = {t: f"{name}:{k}" for k, t in enumerate(sources)}
    for t, users in consumers.items():
        if t in rename:
            for user, pos in users:
                if user.name not in members:
                    user.inputs[pos] = rename[t]
    graph.remove_nodes(members, replaced_by=name)
    attrs = dict(m.attrs, roles=exposed, pass_name=pass_name,
                 original_op_names=[n.name for n in m.nodes], output_sources=sources)
    graph.insert_node(name, m.type, m.inputs, attrs, specs)
    return name


def _reaches(graph: Graph, inputs: List[str], members) -> bool:
    """Does any input tensor depend on a member of the pattern?"""
    seen, stack = set(), [t.rpartition(":")[0] for t in inputs]
    while stack:
        name = stack.pop()
        if name in members:
            return True
        if name in seen:
            continue
        seen.add(name)
        stack.extend(i.rpartition(":")[0] for i in graph.node(name).inputs)
    return False


# -- pattern helpers -------------------------------------------------------------------------
def _users(consumers, node: Node, index=0, type=None):
    return [c for c, _ in consumers.get(f"{node.name}:{index}", []) if type is None or c.type == type]


def _last_axis(node: Node, rank: int) -> bool:
    axes = node.attrs.get("axes")
    return axes is not None and len(axes) == 1 and axes[0] % rank == rank - 1 and node.attrs.get("keep_dims")


def _scalar_const(graph: Graph, tensor: str) -> Optional[float]:
    node = graph.node(tensor.rpartition(":")[0])
    if node.type != "Const" or len(node.attrs["value"]["data"]) != 1:
        return None
    return float(node.attrs["value"]["data"][0])


def _centered(graph: Graph, tensor: str) -> bool:
    """Is the tensor x - mean(x) (a Sub of a ReduceMean of its own first input)?"""
    node = graph.node(tensor.rpartition(":")[0])
    if node.type != "Sub":
        return False
    mean = graph.node(node.inputs[1].rpartition(":")[0])
    return mean.type == "ReduceMean" and mean.inputs[0] == node.inputs[0]


def _other_input(node: Node, tensor: str) -> Optional[str]:
    a, b = node.inputs
    return b if a == tensor else a if b == tensor else None


# -- graph fusion passes ---------------------------------------------------------------------
@fusion_pass("LayerNormFusionPass", GRAPH)
def _layer_norm(graph, node, consumers):
    """ReduceMean, Sub, Square, ReduceMean, Add eps, Rsqrt, Mul, Mul gamma, Add beta (the
    decomposed TF LayerNorm over the last axis) -> LayerNorm."""
    if node.type != "ReduceMean":
        return None
    x = node.inputs[0]
    rank = len(graph.tensor(x).shape)
    if not _last_axis(node, rank):
        return None
    mean = f"{node.name}:0"
    for sub in _users(consumers, node, type="Sub"):
        if sub.inputs != [x, mean]:
            continue
        c = f"{sub.name}:0"
        try:
            sq = next(n for n in _users(consumers, sub, type="Square"))
            var = next(n for n in _users(consumers, sq, type="ReduceMean") if _last_axis(n, rank))
            add_eps = next(n for n in _users(consumers, var, type="Add"))
            eps = _scalar_const(graph, _other_input(add_eps, f"{var.name}:0"))
            rsqrt = next(n for n in _users(consumers, add_eps, type="Rsqrt"))
            norm = next(n for n in _users(consumers, rsqrt, type="Mul")
                        if set(n.inputs) == {c, f"{rsqrt.name}:0"})
            scale = next(n for n in _users(consumers, norm, type="Mul"))
            shift = next(n for n in _users(consumers, scale, type="Add"))
        except StopIteration:
            continue
        if eps is None:
            continue
        gamma = _other_input(scale, f"{norm.name}:0")
        beta = _other_input(shift, f"{scale.name}:0")
        nodes = [node, sub, sq, var, add_eps, rsqrt, norm, scale, shift]
        roles = {"y": f"{shift.name}:0", "mean": mean, "centered": c, "square": f"{sq.name}:0",
                 "variance": f"{var.name}:0", "var_eps": f"{add_eps.name}:0",
                 "inv": f"{rsqrt.name}:0", "normalized": f"{norm.name}:0",
                 "scaled": f"{scale.name}:0"}
        return Match(nodes, [x, gamma, beta], "LayerNorm", {"epsilon": eps}, roles)
    return None


@fusion_pass("RmsNormFusionPass", GRAPH)
def _rms_norm(graph, node, consumers):
    """Square (or Pow 2), ReduceMean, Add eps, Rsqrt (or Sqrt, Reciprocal), Mul x, Mul gamma
    (a decomposed RMSNorm over the last axis: Llama's, T5's) -> RmsNorm, whose squares and
    mean stay float32. Not the tail of a LayerNorm (x there a Sub of its own mean)."""
    if node.type != "ReduceMean":
        return None
    sq = graph.node(node.inputs[0].rpartition(":")[0])
    if not (sq.type == "Square" or sq.type == "Pow" and len(sq.inputs) == 2 and
            _scalar_const(graph, sq.inputs[1]) == 2.0):
        return None
    x = sq.inputs[0]
    shape = graph.tensor(x).shape
    if not _last_axis(node, len(shape)) or _centered(graph, x):
        return None
    try:
        add_eps = next(n for n in _users(consumers, node, type="Add"))
        eps = _scalar_const(graph, _other_input(add_eps, f"{node.name}:0"))
        root = next(n for n in _users(consumers, add_eps) if n.type in ("Rsqrt", "Sqrt"))
        inv = root if root.type == "Rsqrt" else \
            next(n for n in _users(consumers, root, type="Reciprocal"))
        norm = next(n for n in _users(consumers, inv, type="Mul")
                    if set(n.inputs) == {x, f"{inv.name}:0"})
        scale = next(n for n in _users(consumers, norm, type="Mul"))
    except StopIteration:
        return None
    gamma = _other_input(scale, f"{norm.name}:0")
    if eps is None or gamma is None or tuple(graph.tensor(gamma).shape) != tuple(shape[-1:]):
        return None
    nodes = [sq, node, add_eps] + ([root] if root is not inv else []) + [inv, norm, scale]
    roles = {"y": f"{scale.name}:0", "square": f"{sq.name}:0", "mean_square": f"{node.name}:0",
             "var_eps": f"{add_eps.name}:0", "inv": f"{inv.name}:0",
             "normalized": f"{norm.name}:0"}
    return Match(nodes, [x, gamma], "RmsNorm", {"epsilon": eps}, roles)


@fusion_pass("SoftmaxFusionPass", GRAPH)
def _softmax(graph, node, consumers):
    """Softmax over the last axis -> SoftmaxV2 (in fp16 without the max subtraction)."""
    if node.type != "Softmax" or node.attrs["axis"] % len(node.outputs[0].shape) != len(node.outputs[0].shape) - 1:
        return None
    return Match([node], list(node.inputs), "SoftmaxV2", {"axis": -1}, {"y": f"{node.name}:0"})


@fusion_pass("MatMulBiasAddFusionPass", GRAPH)
def _matmul_bias_add(graph, node, consumers):
    """MatMul followed by BiasAdd -> MatMulV2 with the bias added in the accumulator."""
    if node.type != "MatMul":
        return None
    users = _users(consumers, node)
    if len(users) != 1 or users[0].type != "BiasAdd" or users[0].inputs[0] != f"{node.name}:0" \
            or users[0].attrs["data_format"] != "NHWC":
        return None
    bias_add = users[0]
    return Match([node, bias_add], node.inputs + [bias_add.inputs[1]], "MatMulV2",
                 {"transpose_a": node.attrs["transpose_a"], "transpose_b": node.attrs["transpose_b"]},
                 {"y": f"{bias_add.name}:0", "matmul": f"{node.name}:0"})


@fusion_pass("GeluFusionPass", GRAPH)
def _gelu(graph, node, consumers):
    """Gelu (erf form) -> FastGelu (tanh approximation)."""
    if node.type != "Gelu":
        return None
    return Match([node], list(node.inputs), "FastGelu", {}, {"y": f"{node.name}:0"})


@fusion_pass("FlashAttentionFusionPass", GRAPH)
def _flash_attention(graph, node, consumers):
    """Attention as one kernel (Ascend's FlashAttentionScore): a PyTorch script's
    F.scaled_dot_product_attention, whose scores stay inside the kernel in float32. The
    graph IR has no attention op to fuse: in a graph it matches nothing."""
    return None


@fusion_pass("ConvBatchNormFusionPass", GRAPH)
def _conv_batch_norm(graph, node, consumers):
    """Conv2D followed by an inference-mode BatchNorm -> Conv2DBatchNorm (folded weights)."""
    if node.type != "Conv2D":
        return None
    users = _users(consumers, node)
    if len(users) != 1 or users[0].type != "BatchNorm" or users[0].attrs["is_training"] \
            or users[0].inputs[0] != f"{node.name}:0":
        return None
    bn = users[0]
    attrs = {k: node.attrs[k] for k in ("strides", "pads", "data_format", "groups")}
    attrs["epsilon"] = bn.attrs["epsilon"]
    return Match([node, bn], node.inputs + bn.inputs[1:], "Conv2DBatchNorm", attrs,
                 {"y": f"{bn.name}:0", "conv": f"{node.name}:0",
                  "batch_mean": f"{bn.name}:1", "batch_variance": f"{bn.name}:2"})


@fusion_pass("BatchMatMulFusionPass", GRAPH)
def _batch_matmul(graph, node, consumers):
    """BatchMatMul followed by a Mul by a scalar constant -> BatchMatMulV2 (alpha)."""
    if node.type != "BatchMatMul":
        return None
    users = _users(consumers, node)
    if len(users) != 1 or users[0].type != "Mul":
        return None
    mul = users[0]
    alpha = _scalar_const(graph, _other_input(mul, f"{node.name}:0"))
    if alpha is None:
        return None
    return Match([node, mul], list(node.inputs), "BatchMatMulV2",
                 {"adj_x": node.attrs["adj_x"], "adj_y": node.attrs["adj_y"], "alpha": alpha},
                 {"y": f"{mul.name}:0", "batch_matmul": f"{node.name}:0"})


# -- UB fusion passes ------------------------------------------------------------------------
ELTWISE = frozenset({"Add", "Sub", "Mul", "RealDiv", "Div", "Maximum", "Minimum", "Neg",
                     "Square", "Relu", "Tanh", "Sigmoid", "ReluGrad", "TanhGrad", "SigmoidGrad",
                     "GeluGrad", "Exp", "Sqrt", "Rsqrt", "SqrtGrad", "RsqrtGrad"})


def _ub_candidate(node: Node) -> bool:
    return (node.type in ELTWISE and not node.attrs.get("pass_name")
            and all(o.format == "ND" for o in node.outputs))


def _same_kernel_dtype(a: Node, b: Node) -> bool:
    return a.attrs.get("compute_dtype") == b.attrs.get("compute_dtype")


def _eltwise_match(nodes: List[Node], roles: Dict[str, str]) -> Match:
    """FusedEltwise over `nodes` (topological order); its steps reference fused inputs as
    in:k and earlier steps as step:k."""
    index = {n.name: k for k, n in enumerate(nodes)}
    inputs, steps = [], []
    for n in nodes:
        refs = []
        for t in n.inputs:
            src = t.rpartition(":")[0]
            if src in index:
                refs.append(f"step:{index[src]}")
            else:
                if t not in inputs:
                    inputs.append(t)
                refs.append(f"in:{inputs.index(t)}")
        plain = {k: v for k, v in n.attrs.items() if k != "compute_dtype"}
        steps.append({"type": n.type, "inputs": refs, "attrs": plain})
    role_steps = {role: f"step:{index[t.rpartition(':')[0]]}" for role, t in roles.items()}
    attrs = {"steps": steps, "role_steps": role_steps,
             "compute_dtype": nodes[-1].attrs.get("compute_dtype")}
    return Match(nodes, inputs, "FusedEltwise", attrs, roles)


@fusion_pass("TbeEltwiseFusionPass", UB)
def _eltwise_chain(graph, node, consumers):
    """A chain of elementwise ops, each the only reader of the one before, of one compute
    dtype -> one FusedEltwise kernel (intermediates stay fp32 in the unified buffer)."""
    if not _ub_candidate(node):
        return None
    chain = [node]
    while True:
        users = _users(consumers, chain[-1])
        if len(users) != 1 or not _ub_candidate(users[0]) or not _same_kernel_dtype(node, users[0]):
            break
        chain.append(users[0])
    if len(chain) < 2:
        return None
    return _eltwise_match(chain, {"y": f"{chain[-1].name}:0"})


@fusion_pass("TbeMultiOutputFusionPass", UB)
def _multi_output(graph, node, consumers):
    """An elementwise op read by several elementwise ops of its compute dtype -> one
    FusedEltwise kernel with an output per reader."""
    if not _ub_candidate(node):
        return None
    users = _users(consumers, node)
    if len(users) < 2 or not all(_ub_candidate(u) and _same_kernel_dtype(node, u) for u in users):
        return None
    order = {n.name: k for k, n in enumerate(graph.topological_order())}
    users = sorted({u.name: u for u in users}.values(), key=lambda u: order[u.name])
    if any(t.rpartition(":")[0] in {u.name for u in users} for u in users for t in u.inputs):
        return None          # readers that read each other: leave them to the chain pass
    roles = {f"y{k}" if k else "y": f"{u.name}:0" for k, u in enumerate(users)}
    roles["producer"] = f"{node.name}:0"
    return _eltwise_match([node] + users, roles)
