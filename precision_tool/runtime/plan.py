"""Execution plans: the ops a set of fetches needs, in order, and when each value dies."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from .. import kernels
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

    @cached_property
    def stats_table(self) -> "StatsTable":
        """Where its runs put their values' statistics (see StatsTable)."""
        return StatsTable(self)

    @cached_property
    def slots(self) -> Dict[str, int]:
        """Where a run's statistics (RunTrace.stats) put each value: node name -> the row of
        its first output (its outputs follow), and each feed by tensor name (after every
        node's outputs, in sorted order); "" -> the number of rows."""
        out, at = {}, 0
        for node in self.nodes:
            out[node.name] = at
            at += len(node.outputs)
        for name in sorted(self.fed):
            out[name] = at
            at += 1
        out[""] = at
        return out


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


def substituted(outputs: list, given: Dict[int, np.ndarray], store) -> list:
    """A node's outputs when Session.run substitutes some of them: the given ones as
    `store(output, value)` holds them, the others as computed (outputs: None where the node
    did not compute, every output being given)."""
    out = list(outputs) if outputs is not None else [None] * len(given)
    for k, value in given.items():
        out[k] = store(k, np.asarray(value))
    return out


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


class StatsTable:
    """Where a run of one plan puts every value's statistics (RunTrace.stats: a row per value,
    plan.slots; kernels.stats_row's 8 numbers), filled by the executor as it makes the
    values, so that none has to be kept. Made once per plan (ExecutionPlan.stats_table) and
    refilled by each of its runs: a step asks for hundreds of rows.

    start(): the feeds' and variables' rows, in one call (the values a run reads are there
    when it starts); rows[node]: the rows of the results an executor computes, for it to fill
    (the NPU's rounding pass does it on the way: a dict, not a method, for the hundreds of
    look-ups a step makes); passed(node, outputs): values an op makes without computing (the
    variables behind a closed gate); constant(node, value): a constant's, computed once."""

    def __init__(self, plan: "ExecutionPlan"):
        self.slots = plan.slots
        self.table = np.empty((self.slots[""], 8))
        # rows as memoryviews: the C module takes one in a few nanoseconds, where a numpy
        # row's buffer is worked out anew (allocated, compared, freed) for each of a step's
        # hundreds of results
        flat = memoryview(self.table).cast("B").cast("d")
        self.rows = {node.name: [flat[8 * (self.slots[node.name] + k):][:8]
                                 for k in range(len(node.outputs))] for node in plan.nodes}
        fed = sorted(plan.fed)
        variables = [node.name for node in plan.nodes if node.type == "Variable"]
        # the sources in one C call each: a dict's values by name (always a tuple)
        self._pick_feeds, self._pick_variables = _picker(fed), _picker(variables)
        self._sources = kernels.SourceRows(
            self.table, np.array([self.slots[name] for name in fed + variables], dtype=np.int64))
        self._constants: Dict[str, np.ndarray] = {}     # node -> the value its row holds

    def start(self, values: Dict, variables: Dict) -> None:
        self._sources.fill(self._pick_feeds(values) + self._pick_variables(variables))

    def passed(self, node: str, outputs) -> None:
        for out, row in zip(outputs, self.rows[node]):
            kernels.stats_row(out, row)

    def constant(self, node: str, value: np.ndarray) -> None:
        """passed() for a constant's one value, whose row is filled again only when the value
        is not the array it was last (executors hold a constant's value from run to run and
        never modify an array; nothing else writes a constant's row)."""
        if self._constants.get(node) is not value:
            self.passed(node, [value])
            self._constants[node] = value


def _picker(names):
    """mapping -> the tuple of its values for names, in one call."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    return lambda mapping: tuple(mapping[name] for name in names)


STATS_ONLY = "stats"     # what an observer's begin_run returns to be given statistics only


class RunTrace:
    """What one run computed, for observers: `outputs[i]` is the list of plan.nodes[i]'s
    outputs, `feeds` the fed values by tensor name, `tasks` the NPU's kernel launches in
    order (None on the CPU) and `status` the OR of their status words. Executors never
    modify an array after producing it, so the trace holds each value as it was when its op
    ran.

    A run whose observers all asked for statistics only (STATS_ONLY) keeps no values:
    `outputs` is None and `stats` holds, per value (its row: plan.slots), kernels.stats_row's
    8 numbers, computed as the values were made. The table is the plan's (StatsTable), refilled
    by its next run: an observer copies what it keeps."""

    def __init__(self, plan: ExecutionPlan, outputs: Optional[List[list]], feeds: Dict,
                 tasks=None, stats: Optional[np.ndarray] = None, status: int = 0):
        self.plan, self.outputs, self.feeds, self.tasks = plan, outputs, feeds, tasks
        self.stats, self.status = stats, status

    def row(self, tensor: str) -> int:
        """A tensor's row in stats."""
        if tensor in self.feeds:
            return self.plan.slots[tensor]
        node, k = split_tensor_name(tensor)
        return self.plan.slots[node] + k

    def value(self, tensor: str):
        """A tensor's value: a feed, or the output of its producer."""
        if tensor in self.feeds:
            return self.feeds[tensor]
        node, k = split_tensor_name(tensor)
        return self.outputs[self.plan.producers[node]][k]

    def scalar(self, tensor: str) -> float:
        """The value of a one-element tensor, from its value or from its statistics."""
        if self.outputs is not None or tensor in self.feeds:
            return float(np.asarray(self.value(tensor)).reshape(-1)[0])
        hi, _, _, _, nan, pos, neg, size = self.stats[self.row(tensor)]
        if size != 1:
            raise ValueError(f"{tensor!r} holds {int(size)} values, not one")
        return float("nan") if nan else float("inf") if pos else float("-inf") if neg else float(hi)

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
