"""Execution plans: the ops a set of fetches needs, in order, and when each value dies."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, FrozenSet, List, Tuple

import numpy as np

from ..graph import Graph, split_tensor_name
from ..graph.ir import Node


@dataclass(frozen=True)
class ExecutionPlan:
    nodes: Tuple[Node, ...]                 # to run, in topological order
    release: Tuple[Tuple[str, ...], ...]    # tensor names no longer needed after nodes[i]
    fed: FrozenSet[str]

    @cached_property
    def producers(self) -> Dict[str, int]:
        """node name -> its index in nodes (where a RunTrace finds a node's outputs)"""
        return {node.name: i for i, node in enumerate(self.nodes)}


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


def run_plan(plan: ExecutionPlan, values: Dict, variables: Dict, execute, trace=None) -> Dict:
    """Run the plan's ops in order with `execute(node) -> outputs`: store the outputs, append
    them to `trace` when given (the dump hook point: one list append per op, a RunTrace
    finds each input among them), apply update ops to their variables, and drop values
    after their last reader."""
    from ..ops import registry
    with np.errstate(all="ignore"):   # inf/nan are data here: status words and analysis report them
        for node, release in zip(plan.nodes, plan.release):
            outputs = execute(node)
            if trace is not None:
                trace.append(outputs)
            for k, out in enumerate(outputs):
                values[f"{node.name}:{k}"] = out
            for k, pos in enumerate(registry.get(node.type).updates):
                variables[node.inputs[pos].rpartition(":")[0]] = outputs[k]
            for name in release:
                values.pop(name, None)
    return values


class RunTrace:
    """What one run computed, for observers: `outputs[i]` is the list of plan.nodes[i]'s
    outputs, `feeds` the fed values by tensor name, `tasks` the NPU's kernel launches in
    order (None on the CPU). Executors never modify an array after producing it, so the
    trace holds each value as it was when its op ran."""

    def __init__(self, plan: ExecutionPlan, outputs: List[list], feeds: Dict, tasks=None):
        self.plan, self.outputs, self.feeds, self.tasks = plan, outputs, feeds, tasks

    def value(self, tensor: str):
        """A tensor's value: a feed, or the output of its producer."""
        if tensor in self.feeds:
            return self.feeds[tensor]
        node, _, k = tensor.rpartition(":")
        return self.outputs[self.plan.producers[node]][int(k)]

    def records(self):
        """(node, inputs, outputs, task) for every op run, in order; task: the node's
        launch on the NPU (None for ops that launch nothing, and on the CPU)."""
        tasks = iter(self.tasks or ())
        task = next(tasks, None)
        for node, outputs in zip(self.plan.nodes, self.outputs):
            mine = None
            if task is not None and task.name == node.name:
                mine, task = task, next(tasks, None)
            yield node, [self.value(t) for t in node.inputs], outputs, mine
