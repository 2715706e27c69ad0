"""What an API call made in autograd's graph: the nodes its backward runs, and where the
gradients leave it for each of the call's inputs.

A call like `F.linear` on a 3-d input makes several nodes (a view's, the matmul's, the
transpose of the weight); its outputs hang on the last. Its backward is all of them: the
gradients flowing in are those its outputs' nodes receive, the gradients flowing out are
those its nodes hand, along their edges, to the nodes of the call's inputs (an input's own
grad_fn, or a leaf's AccumulateGrad). The walk stops there, and at any node made before the
call (autograd numbers the nodes of a thread in the order it makes them: `next_node` before
the call): a tensor the call read that is not among its arguments leads out of it. A call
may make thousands of nodes (an LSTM's cells run one time step at a time)."""
from __future__ import annotations

from typing import List, NamedTuple, Sequence, Tuple


class CallGraph(NamedTuple):
    nodes: list                     # every node the call made
    heads: list                     # the nodes the call's outputs hang on
    edges: List[Tuple[object, int, int]]     # (node, its edge index, the input it reaches)


def next_node() -> int:
    """The number autograd gives the next node it makes on this thread: a call's nodes are
    those numbered from it on, taken before the call."""
    import torch
    return torch._C._autograd._get_sequence_nr()


def where_from(t) -> tuple:
    """What a call's backward needs of an input, taken before the call (an in-place call
    gives the tensor a new grad_fn): its node and output index, or the leaf itself."""
    return (t.grad_fn, t.output_nr, t if t.requires_grad and t.grad_fn is None else None)


def call_graph(ins: Sequence[tuple], outs: Sequence, first: int) -> CallGraph:
    """The call's nodes and its edges to its inputs (ins: where_from of each tensor it
    read, in order; first: next_node before the call)."""
    leaves = {id(leaf): k for k, (_, _, leaf) in enumerate(ins) if leaf is not None}
    ends = {(id(fn), nr): k for k, (fn, nr, _) in enumerate(ins) if fn is not None}
    stop = {id(fn) for fn, _, _ in ins if fn is not None}
    heads = list({id(o.grad_fn): o.grad_fn for o in outs
                  if o.grad_fn is not None and id(o.grad_fn) not in stop and
                  o.grad_fn._sequence_nr() >= first}.values())
    nodes, edges, seen, todo = [], [], set(), list(heads)
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        for i, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if type(nxt).__name__ == "AccumulateGrad":
                k = leaves.get(id(nxt.variable))
                if k is not None:
                    edges.append((node, i, k))
            elif id(nxt) in stop:
                k = ends.get((id(nxt), nr))
                if k is not None:
                    edges.append((node, i, k))
            elif nxt._sequence_nr() >= first:
                todo.append(nxt)
    return CallGraph(nodes, heads, edges)
