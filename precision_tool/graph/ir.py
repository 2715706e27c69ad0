"""The graph IR: named nodes in insertion order, each output a typed tensor.

Op names are user-visible and stable: they are the join key between NPU and golden dumps.
Names are TF-style: hierarchical with '/', made unique with '_1', '_2', ... suffixes.
"""
from __future__ import annotations

import contextlib
import contextvars
import heapq
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import GraphError, GraphFormatError
from . import dtypes

Shape = Tuple[Optional[int], ...]

# The op types that hold or feed values and run no kernel: the compiler launches no task
# for them, a dump has no kernel of them, the cost model gives them no time.
NOT_KERNELS = frozenset({"Placeholder", "Variable", "Const", "NoOp"})


def _normalize_shape(shape) -> Shape:
    if shape is None:
        raise GraphError("a tensor shape is required (use None for an unknown dimension)")
    try:
        dims = tuple(shape)
    except TypeError:
        raise GraphError(f"shape must be a sequence of ints or None, got {shape!r}") from None
    out = []
    for d in dims:
        if d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0):
            out.append(None if d is None else int(d))
        else:
            raise GraphError(f"bad dimension {d!r} in shape {list(dims)}")
    return tuple(out)


def format_shape(shape: Shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


@dataclass(frozen=True)
class TensorSpec:
    """Static type of a tensor: shape (None = unknown dimension) and canonical dtype name.

    On a compiled NPU graph a tensor may live in a device format: `format` names it
    (e.g. "NC1HWC0"), `shape` is then the device shape and `original_shape` the logical one.
    """
    shape: Shape
    dtype: str
    format: str = "ND"
    original_shape: Optional[Shape] = None

    @staticmethod
    def make(shape, dtype, format="ND", original_shape=None) -> "TensorSpec":
        return TensorSpec(_normalize_shape(shape), dtypes.canonical(dtype), str(format),
                          None if original_shape is None else _normalize_shape(original_shape))

    @property
    def logical_shape(self) -> Shape:
        return self.original_shape if self.original_shape is not None else self.shape

    def with_dtype(self, dtype: str) -> "TensorSpec":
        return TensorSpec(self.shape, dtype, self.format, self.original_shape)

    def __str__(self):
        fmt = "" if self.format == "ND" else f" {self.format}"
        return f"{self.dtype}{format_shape(self.shape)}{fmt}"


def _plain(value):
    """Attribute values in JSON-stable form: lists not tuples, Python scalars not numpy."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise GraphError(f"attribute value {value!r} of type {type(value).__name__} is not serialisable")


class Node:
    """One op instance. `inputs` are tensor names 'node:index'."""

    __slots__ = ("graph", "name", "type", "inputs", "attrs", "outputs")

    def __init__(self, graph, name: str, type: str, inputs: Sequence[str], attrs: Dict[str, Any],
                 outputs: Sequence[TensorSpec]):
        self.graph = graph
        self.name = name
        self.type = type
        self.inputs = list(inputs)
        self.attrs = _plain(dict(attrs))
        self.outputs = list(outputs)

    def output(self, index: int = 0) -> "Tensor":
        if not 0 <= index < len(self.outputs):
            raise GraphError(f"op {self.name!r} ({self.type}) has {len(self.outputs)} outputs, "
                             f"asked for output {index}")
        return Tensor(self, index)

    @property
    def input_tensors(self) -> List["Tensor"]:
        return [self.graph.tensor(name) for name in self.inputs]

    def __repr__(self):
        return f"<Node {self.name} type={self.type}>"


class Tensor:
    """A reference to one output of a node. Operators (+, *, @, ...) are installed by `ops`."""

    __slots__ = ("node", "index")

    def __init__(self, node: Node, index: int):
        self.node = node
        self.index = index

    @property
    def op(self) -> Node:
        return self.node

    @property
    def graph(self) -> "Graph":
        return self.node.graph

    @property
    def name(self) -> str:
        return f"{self.node.name}:{self.index}"

    @property
    def spec(self) -> TensorSpec:
        return self.node.outputs[self.index]

    @property
    def shape(self) -> Shape:
        return self.spec.shape

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def ndim(self) -> int:
        return len(self.spec.shape)

    def __eq__(self, other):
        return isinstance(other, Tensor) and other.node is self.node and other.index == self.index

    def __hash__(self):
        return hash((id(self.node), self.index))

    def __repr__(self):
        return f"<Tensor {self.name} {self.spec}>"


def split_tensor_name(name: str) -> Tuple[str, int]:
    """'a/b:1' -> ('a/b', 1); a bare op name means output 0."""
    node, sep, index = name.rpartition(":")
    if sep and index.isdigit():
        return node, int(index)
    return name, 0


_DEFAULT_GRAPHS: contextvars.ContextVar = contextvars.ContextVar("precision_tool_default_graph",
                                                                 default=())


def get_default_graph() -> "Graph":
    stack = _DEFAULT_GRAPHS.get()
    if not stack:
        raise GraphError("no default graph: build ops inside `with pt.Graph('name').as_default():`")
    return stack[-1]


class Graph:
    """Named nodes in insertion order. Build with ops inside `with g.as_default():`."""

    def __init__(self, name: str = "graph", seed: int = 0):
        if not isinstance(name, str) or not name:
            raise GraphError(f"graph name must be a non-empty string, got {name!r}")
        self.name = name
        self.seed = int(seed)
        self._nodes: Dict[str, Node] = {}
        self._suffix_hint: Dict[str, int] = {}    # unique_name: highest suffix known taken
        self._scopes: List[str] = []
        self._topo_cache: Optional[List[Node]] = None
        self.collections: Dict[str, List[str]] = {}   # e.g. "update_ops": BatchNorm statistics

    # -- building -------------------------------------------------------------------------
    @contextlib.contextmanager
    def as_default(self):
        token = _DEFAULT_GRAPHS.set(_DEFAULT_GRAPHS.get() + (self,))
        try:
            yield self
        finally:
            _DEFAULT_GRAPHS.reset(token)

    @contextlib.contextmanager
    def name_scope(self, name: str):
        """Prefix op names with `name/`. A name ending in '/' replaces the current scope."""
        if name.endswith("/"):
            scope = name.rstrip("/")
        else:
            scope = f"{self.current_scope}/{name}" if self._scopes and self.current_scope else name
        saved = self._scopes
        self._scopes = saved + [scope]
        try:
            yield scope
        finally:
            self._scopes = saved

    @property
    def current_scope(self) -> str:
        return self._scopes[-1] if self._scopes else ""

    def unique_name(self, base: str) -> str:
        """TF-style: the scoped name if free, else with the first free `_<k>` suffix."""
        if not base or any(part == "" for part in base.split("/")):
            raise GraphError(f"invalid op name {base!r}")
        full = f"{self.current_scope}/{base}" if self.current_scope else base
        if full not in self._nodes:
            return full
        # full_1 .. full_<hint> are all taken (no node was removed since): start after them,
        # or naming n ops alike costs n^2
        k = self._suffix_hint.get(full, 0) + 1
        while f"{full}_{k}" in self._nodes:
            k += 1
        self._suffix_hint[full] = k
        return f"{full}_{k}"

    def add_node(self, type: str, inputs: Sequence[Tensor], attrs: Dict[str, Any],
                 outputs: Sequence[TensorSpec], name: Optional[str] = None) -> Node:
        for t in inputs:
            if not isinstance(t, Tensor) or t.graph is not self:
                raise GraphError(f"input {t!r} of new {type} op is not a tensor of graph {self.name!r}")
        node = Node(self, self.unique_name(name or type), type, [t.name for t in inputs], attrs,
                    outputs)
        self._insert(node)
        return node

    def insert_node(self, name: str, type: str, inputs: Sequence[str], attrs: Dict[str, Any],
                    outputs: Sequence[TensorSpec]) -> Node:
        """Add a node under an exact name reading tensors by name (graph rewriting)."""
        for t in inputs:
            src, index = split_tensor_name(t)
            if src not in self._nodes or index >= len(self._nodes[src].outputs):
                raise GraphError(f"new op {name!r} reads {t!r}, which no op produces")
        node = Node(self, name, type, inputs, attrs, outputs)
        self._insert(node)
        return node

    def remove_nodes(self, names, replaced_by: Optional[str] = None) -> None:
        """Drop nodes nothing else reads (e.g. gradient ops no result depends on). A rewrite
        that puts a new node under one of the names passes it as `replaced_by`: readers of
        that name then read the new node."""
        names = set(names)
        for n in self._nodes.values():
            if n.name not in names and any(split_tensor_name(i)[0] in names - {replaced_by}
                                           for i in n.inputs):
                raise GraphError(f"cannot remove inputs of op {n.name!r}")
        for name in names:
            del self._nodes[name]
        self._suffix_hint.clear()          # a freed name may be the first free one again
        for members in self.collections.values():
            members[:] = [m for m in members if m not in names]
        self._topo_cache = None

    def _insert(self, node: Node):
        if node.name in self._nodes:
            raise GraphFormatError(f"duplicate op name {node.name!r}")
        self._nodes[node.name] = node
        self._topo_cache = None

    def add_to_collection(self, collection: str, node: Node) -> None:
        """Remember `node` under `collection` (TF-style; optimizers run "update_ops" each step)."""
        names = self.collections.setdefault(collection, [])
        if node.name not in names:
            names.append(node.name)

    def get_collection(self, collection: str) -> List[Node]:
        return [self.node(name) for name in self.collections.get(collection, [])]

    # -- queries --------------------------------------------------------------------------
    @property
    def nodes(self) -> List[Node]:
        return list(self._nodes.values())

    def __len__(self):
        return len(self._nodes)

    def __contains__(self, name: str):
        return name in self._nodes

    def node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise GraphError(f"graph {self.name!r} has no op named {name!r}") from None

    def tensor(self, name: str) -> Tensor:
        node_name, index = split_tensor_name(name)
        return self.node(node_name).output(index)

    def consumers(self) -> Dict[str, List[Tuple[Node, int]]]:
        """tensor name -> [(consumer node, input position)], in insertion order."""
        out: Dict[str, List[Tuple[Node, int]]] = {}
        for n in self._nodes.values():
            for pos, name in enumerate(n.inputs):
                out.setdefault(name, []).append((n, pos))
        return out

    def topological_order(self) -> List[Node]:
        """Kahn's algorithm, ties broken by insertion order (so a built graph keeps its order)."""
        if self._topo_cache is not None:
            return list(self._topo_cache)
        position = {name: i for i, name in enumerate(self._nodes)}
        pending = {}
        users: Dict[str, List[str]] = {}
        for n in self._nodes.values():
            deps = set()
            for inp in n.inputs:
                src, _ = split_tensor_name(inp)
                if src not in self._nodes:
                    raise GraphFormatError(f"op {n.name!r} reads {inp!r}, which no op produces")
                deps.add(src)
            pending[n.name] = len(deps)
            for d in deps:
                users.setdefault(d, []).append(n.name)
        ready = [position[name] for name, k in pending.items() if k == 0]
        heapq.heapify(ready)
        names = list(self._nodes)
        order = []
        while ready:
            name = names[heapq.heappop(ready)]
            order.append(self._nodes[name])
            for u in users.get(name, ()):
                pending[u] -= 1
                if pending[u] == 0:
                    heapq.heappush(ready, position[u])
        if len(order) != len(self._nodes):
            stuck = next(name for name, k in pending.items() if k > 0)
            raise GraphFormatError(f"graph {self.name!r} has a cycle through op {stuck!r}")
        self._topo_cache = order
        return list(order)

    def __repr__(self):
        return f"<Graph {self.name} with {len(self._nodes)} ops>"

