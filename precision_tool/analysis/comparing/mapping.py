"""Which golden tensor an NPU tensor stands for.

An NPU op maps to the golden op of the same name. A fused op's outputs map through the
original tensor each stands for (`output_sources`). Casts and TransData the compiler
inserted carry their input: they map to whatever that input maps to. An input of a kernel
maps through its producer in the same way.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from ...graph import GraphView, NodeView, split_tensor_name


class TensorMap:
    """Built once from the compiled graph (Workspace.compiled_graph; None: a run without
    one, where every tensor stands for itself)."""

    def __init__(self, compiled_graph: Optional[GraphView]):
        self._nodes: Dict[str, NodeView] = compiled_graph.nodes if compiled_graph else {}
        self._cache: Dict[str, Optional[str]] = {}

    def golden_tensor(self, tensor: str) -> Optional[str]:
        """The original (golden) tensor name for a compiled tensor, or None if NPU-only."""
        if tensor not in self._cache:
            self._cache[tensor] = self._resolve(tensor, 0)
        return self._cache[tensor]

    def _resolve(self, tensor: str, depth: int) -> Optional[str]:
        if depth > 64:                     # a malformed graph must not loop forever
            return None
        name, index = split_tensor_name(tensor)
        node = self._nodes.get(name)
        if node is None:
            return tensor                  # not in the compiled graph: take the name as is
        attrs = node.attrs
        if attrs.get("inserted_by"):       # a compiler-inserted Cast or TransData
            inputs = node.inputs
            return self._resolve(inputs[0], depth + 1) if inputs else None
        sources = attrs.get("output_sources")
        if sources:
            return sources[index] if index < len(sources) else None
        return tensor

    def readers(self, op_name: str) -> List[NodeView]:
        """The compiled nodes that read an output of the op (a walk over the graph)."""
        return [n for n in self._nodes.values()
                if any(split_tensor_name(t)[0] == op_name for t in n.inputs)]

    def node(self, op_name: str) -> Optional[NodeView]:
        """The compiled node, or None."""
        return self._nodes.get(op_name)

    def attrs(self, op_name: str) -> dict:
        """The compiled node's attributes ({} for an op the graph does not hold)."""
        node = self._nodes.get(op_name)
        return node.attrs if node is not None else {}

    def original_ops(self, op_name: str):
        return list(self.attrs(op_name).get("original_op_names", [])) or [op_name]

    def stands_for(self, op_name: str) -> set:
        """The original tensors an op's outputs stand for: a fused op's every role, an
        inserted Cast's input's, any other op's own outputs."""
        node = self._nodes.get(op_name)
        if node is None:
            return {f"{op_name}:0"}
        found = {self.golden_tensor(f"{op_name}:{k}") for k in range(len(node.outputs) or 1)}
        found |= set(node.attrs.get("output_sources", []))
        return found - {None}

    def pass_name(self, op_name: str) -> str:
        return self.attrs(op_name).get("pass_name", "")


def placed_types(op_type: str, attrs: dict) -> list:
    """The op types a precision policy placed for a compiled kernel: the policy runs after
    graph fusion (a fused MatMulV2 is placed as MatMulV2) and before UB fusion (a UB
    kernel's steps were placed one by one, never as "FusedEltwise")."""
    steps = (attrs or {}).get("steps")
    if isinstance(steps, list):
        return [s["type"] for s in steps if isinstance(s, dict) and s.get("type")]
    return [op_type]
