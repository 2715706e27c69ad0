"""Reverse-mode autodiff that writes gradient ops into the graph, named as TF names them:
`gradients/<op name>_grad/<OpType>`; gradients reaching one tensor from several consumers are
summed by a `gradients/AddN` op."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..errors import GraphError
from ..graph import Tensor, dtypes
from ..ops import registry
from ..ops.math_ops import add_n, ones_like


def _relevant_nodes(graph, ys: Sequence[Tensor], xs: Sequence[Tensor]):
    """Nodes on some path from an x to a y, in topological order."""
    order = graph.topological_order()
    from_x = {x.node.name for x in xs}
    for n in order:
        if n.name not in from_x and any(i.rpartition(":")[0] in from_x for i in n.inputs):
            from_x.add(n.name)
    to_y = {y.node.name for y in ys}
    for n in reversed(order):
        if n.name in to_y:
            to_y.update(i.rpartition(":")[0] for i in n.inputs)
    return [n for n in order if n.name in from_x and n.name in to_y]


def gradients(ys, xs, grad_ys=None) -> List[Optional[Tensor]]:
    """d(sum of ys)/d(x) for each x, as new graph ops; None where x does not affect ys."""
    ys = [ys] if isinstance(ys, Tensor) else list(ys)
    xs = [xs] if isinstance(xs, Tensor) else list(xs)
    if not ys:
        raise GraphError("gradients needs at least one target tensor")
    graph = ys[0].graph
    for t in ys + xs:
        if not isinstance(t, Tensor) or t.graph is not graph:
            raise GraphError(f"{t!r} is not a tensor of graph {graph.name!r}")
    for y in ys:
        if not dtypes.is_float(y.dtype):
            raise GraphError(f"cannot differentiate {y.name} of dtype {y.dtype}")
    pending: Dict[str, List[Tensor]] = {}
    existing = {n.name for n in graph.nodes}
    with graph.as_default():
        with graph.name_scope("gradients/"):
            seeds = grad_ys if grad_ys is not None else [ones_like(y, name="Fill") for y in ys]
        for y, g in zip(ys, seeds):
            pending.setdefault(y.name, []).append(g)
        for node in reversed(_relevant_nodes(graph, ys, xs)):
            dys = []
            for k in range(len(node.outputs)):
                total = _total(pending.get(f"{node.name}:{k}"), graph)
                if total is not None:
                    pending[f"{node.name}:{k}"] = [total]   # summed once, read again below for xs
                dys.append(total)
            if all(d is None for d in dys) or not node.inputs:
                continue
            op = registry.get(node.type)
            if op.grad is None:
                raise GraphError(f"op {node.name!r} ({node.type}) lies between the loss and a "
                                 f"variable but has no gradient")
            with graph.name_scope(f"gradients/{node.name}_grad/"):
                grads = op.grad(registry.GradContext(node, dys))
            if len(grads) != len(node.inputs):
                raise RuntimeError(f"gradient of {node.type} returned {len(grads)} values "
                                   f"for {len(node.inputs)} inputs")
            for name, g in zip(node.inputs, grads):
                if g is not None:
                    pending.setdefault(name, []).append(g)
        result = [_total(pending.get(x.name), graph) for x in xs]
    _prune(graph, existing, [g for g in result if g is not None])
    return result


def _prune(graph, existing, keep: List[Tensor]) -> None:
    """Remove the gradient ops this call built that no returned gradient depends on (e.g.
    the gradient of a constant operand): they would only clutter dumps and block fusion."""
    needed = set()
    stack = [t.node.name for t in keep]
    while stack:
        name = stack.pop()
        if name in needed or name in existing:
            continue
        needed.add(name)
        stack.extend(i.rpartition(":")[0] for i in graph.node(name).inputs)
    graph.remove_nodes([n.name for n in graph.nodes if n.name not in existing and n.name not in needed])


def _total(grads: Optional[List[Tensor]], graph) -> Optional[Tensor]:
    if not grads:
        return None
    if len(grads) == 1:
        return grads[0]
    with graph.name_scope("gradients/"):
        return add_n(grads, name="AddN")
