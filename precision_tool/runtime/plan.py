"""Execution plans: the ops a set of fetches needs, in order, and when each value dies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Tuple

import numpy as np

from ..graph import Graph, split_tensor_name
from ..graph.ir import Node


@dataclass(frozen=True)
class ExecutionPlan:
    nodes: Tuple[Node, ...]                 # to run, in topological order
    release: Tuple[Tuple[str, ...], ...]    # tensor names no longer needed after nodes[i]
    fed: FrozenSet[str]


def build_plan(graph: Graph, fetch_nodes: List[str], fetch_tensors: List[str],
               fed: FrozenSet[str]) -> ExecutionPlan:
    needed = set()
    stack = list(fetch_nodes) + [split_tensor_name(t)[0] for t in fetch_tensors]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        node = graph.node(name)
        for inp in node.inputs:
            if inp not in fed:
                stack.append(split_tensor_name(inp)[0])
    order = [n for n in graph.topological_order() if n.name in needed]
    keep = set(fetch_tensors)
    last_use: Dict[str, int] = {}
    for i, n in enumerate(order):
        for inp in n.inputs:
            last_use[inp] = i
    release: List[List[str]] = [[] for _ in order]
    for name, i in last_use.items():
        if name not in keep:
            release[i].append(name)
    return ExecutionPlan(tuple(order), tuple(tuple(r) for r in release), fed)


def read_source(node, values, variables):
    """The value of a feed or a variable (ops that hold state rather than compute), or None
    for any other op. Both executors read them the same way."""
    if node.type == "Placeholder":
        name = f"{node.name}:0"
        if name not in values:
            from ..errors import FeedError
            raise FeedError(f"placeholder {node.name!r} must be fed a value of {node.outputs[0]}")
        return [values[name]]
    if node.type == "Variable":
        return [variables[node.name]]
    return None


def run_plan(plan: ExecutionPlan, values: Dict, variables: Dict, execute, observe=None) -> Dict:
    """Run the plan's ops in order with `execute(node) -> outputs`: store the outputs, show
    them with their inputs to `observe(node, inputs, outputs)` (the dump hook point), apply
    update ops to their variables, and drop values after their last reader."""
    from ..ops import registry
    with np.errstate(all="ignore"):   # inf/nan are data here: status words and analysis report them
        for node, release in zip(plan.nodes, plan.release):
            outputs = execute(node)
            if observe is not None:
                observe(node, [values[i] for i in node.inputs], outputs)
            for k, out in enumerate(outputs):
                values[f"{node.name}:{k}"] = out
            for k, pos in enumerate(registry.get(node.type).updates):
                variables[node.inputs[pos].rpartition(":")[0]] = outputs[k]
            for name in release:
                values.pop(name, None)
    return values
