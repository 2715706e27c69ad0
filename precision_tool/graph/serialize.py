"""Graph <-> JSON. The format round-trips exactly: save(load(text)) == text."""
from __future__ import annotations

import json
from typing import Callable, Dict, Iterator, NamedTuple, Optional

from ..errors import GraphError, GraphFormatError
from .ir import Graph, Node, TensorSpec, split_tensor_name

FORMAT = "precision_tool.graph"
VERSION = 1


def graph_to_dict(graph: Graph) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": graph.name,
        "seed": graph.seed,
        "nodes": [
            {
                "name": n.name,
                "type": n.type,
                "inputs": list(n.inputs),
                "attrs": n.attrs,
                "outputs": [_spec_to_dict(o) for o in n.outputs],
            }
            for n in graph.nodes
        ],
        "collections": {k: list(v) for k, v in graph.collections.items()},
    }


def _spec_to_dict(spec: TensorSpec) -> dict:
    out = {"shape": list(spec.shape), "dtype": spec.dtype}
    if spec.format != "ND":
        out["format"] = spec.format
    if spec.original_shape is not None:
        out["original_shape"] = list(spec.original_shape)
    return out


def _spec_from_dict(d: dict) -> TensorSpec:
    return TensorSpec.make(d["shape"], d["dtype"], d.get("format", "ND"), d.get("original_shape"))


def graph_to_json(graph: Graph) -> str:
    return json.dumps(graph_to_dict(graph), indent=1, sort_keys=False)


def _entry(entry: dict, specs: bool = True):
    """A node entry's name, type, inputs, attrs and output specs, each checked for its kind
    (KeyError, TypeError or GraphError when one is not); specs=False checks the outputs'
    form only (a list of objects with a dtype) and returns them as they are."""
    name, type_ = entry["name"], entry["type"]
    if not isinstance(name, str) or not isinstance(type_, str) or not name:
        raise TypeError("name and type must be non-empty strings")
    inputs = entry.get("inputs", [])
    if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
        raise TypeError("inputs must be a list of tensor names")
    attrs = entry.get("attrs", {})
    if not isinstance(attrs, dict):
        raise TypeError("attrs must be an object")
    outputs = entry.get("outputs", [])
    if not specs:
        if not isinstance(outputs, list) or not all(isinstance(o, dict) and
                                                    isinstance(o.get("dtype"), str) for o in outputs):
            raise TypeError("outputs must be a list of tensor specs")
        return name, type_, inputs, attrs, outputs
    return name, type_, inputs, attrs, [_spec_from_dict(o) for o in outputs]


class NodeView(NamedTuple):
    """A node of a graph's JSON as read, each field checked for its kind: what the analysis
    reads of a compiled graph. outputs: the specs as the JSON holds them ({"shape", "dtype",
    "format", ...}: a compiled tensor in 5HD is not a TensorSpec of the original graph)."""
    name: str
    type: str
    inputs: list
    attrs: dict
    outputs: list


class GraphView:
    """A graph's JSON read as NodeViews by name, in the order the JSON lists them (a valid
    execution order): no Graph is built, no shape checked. Its checks are _entry's."""

    def __init__(self, data, checked: bool = False):
        """checked: the JSON has passed check_graph_dict (or is bytes our own dumper wrote,
        unchanged): its nodes are taken as they are, without checking each again."""
        entries = graph_nodes(data)
        self.name = str(data.get("name", "graph"))
        try:
            self.seed = int(data.get("seed", 0))
        except (TypeError, ValueError):
            raise GraphFormatError(f"graph seed {data.get('seed')!r} is not an integer") from None
        self.nodes: Dict[str, NodeView] = {}
        for i, entry in enumerate(entries):
            try:
                node = NodeView(entry["name"], entry["type"], entry.get("inputs", []),
                                entry.get("attrs", {}), entry.get("outputs", [])) if checked \
                    else NodeView(*_entry(entry, specs=False))
            except (KeyError, TypeError, GraphError) as e:
                raise GraphFormatError(f"node #{i} of graph JSON is malformed: {e}") from None
            self.nodes[node.name] = node

    def __iter__(self) -> Iterator[NodeView]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, name) -> bool:
        return name in self.nodes

    def get(self, name: str) -> Optional[NodeView]:
        return self.nodes.get(name)


def graph_nodes(data) -> list:
    """The node list of a graph's dict form, its header checked."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise GraphFormatError(f"not a precision_tool graph (expected format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise GraphFormatError(f"unsupported graph format version {data.get('version')!r}")
    nodes = data.get("nodes")
    if not isinstance(nodes, list):
        raise GraphFormatError("graph JSON has no 'nodes' list")
    return nodes


def _source(tensor: str) -> str:
    """The op a tensor name ('a/b:1', or a bare op name) comes from."""
    return split_tensor_name(tensor)[0]


def check_graph_dict(data, known_type: Callable[[str], bool]) -> None:
    """graph_from_dict's checks (each entry well formed, names unique, every input produced,
    no cycle, every type known) without building the graph: a compiled graph that is read
    as JSON (its mapping) is checked as a graph, at the cost of a walk over its entries."""
    sources = {}                     # op -> the ops it reads
    ordered = True                   # every op reads only ops before it (as ours are written)
    for i, entry in enumerate(graph_nodes(data)):
        try:
            name, type_, inputs, _, _ = _entry(entry, specs=False)
        except (KeyError, TypeError, GraphError) as e:
            raise GraphFormatError(f"node #{i} of graph JSON is malformed: {e}") from None
        if name in sources:
            raise GraphFormatError(f"node #{i} of graph JSON is malformed: duplicate op name {name!r}")
        if not known_type(type_):
            raise GraphFormatError(f"op {name!r} has unknown type {type_!r}")
        srcs = sources[name] = set(map(_source, inputs)) if inputs else ()
        if ordered and srcs:
            ordered = name not in srcs and srcs <= sources.keys()
    if ordered:                      # in topological order already: no cycle, none dangling
        return
    # Kahn's algorithm over the names: a dangling input or a cycle leaves ops unvisited
    users, pending, ready = {}, {}, []
    for name, srcs in sources.items():
        for src in srcs:
            if src not in sources:
                raise GraphFormatError(f"op {name!r} reads from {src!r}, which is no op")
            users.setdefault(src, []).append(name)
        pending[name] = len(srcs)
        if not srcs:
            ready.append(name)
    done = 0
    while ready:
        done += 1
        for u in users.get(ready.pop(), ()):
            pending[u] -= 1
            if not pending[u]:
                ready.append(u)
    if done != len(sources):
        stuck = next(name for name, k in pending.items() if k > 0)
        raise GraphFormatError(f"graph {data.get('name', 'graph')!r} has a cycle through op {stuck!r}")


def graph_from_dict(data, validate: Optional[Callable[[Node], None]] = None) -> Graph:
    """Build a Graph from its dict form; `validate(node)` may reject a node (unknown type...)."""
    nodes = graph_nodes(data)
    try:
        graph = Graph(data.get("name", "graph"), int(data.get("seed", 0)))
    except (GraphError, TypeError, ValueError) as e:
        raise GraphFormatError(f"bad graph header: {e}") from None
    for i, entry in enumerate(nodes):
        try:
            name, type_, inputs, attrs, outputs = _entry(entry)
            node = Node(graph, name, type_, inputs, attrs, outputs)
        except (KeyError, TypeError, GraphError) as e:
            raise GraphFormatError(f"node #{i} of graph JSON is malformed: {e}") from None
        graph._insert(node)
    collections = data.get("collections", {})
    if not isinstance(collections, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) and n in graph for n in v)
            for v in collections.values()):
        raise GraphFormatError("graph JSON 'collections' must map names to lists of op names")
    graph.collections = {str(k): list(v) for k, v in collections.items()}
    graph.topological_order()  # rejects dangling inputs and cycles now, not at run time
    if validate is not None:
        for node in graph.nodes:
            validate(node)
    return graph


def graph_from_json(text: str, validate=None) -> Graph:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GraphFormatError(f"graph JSON does not parse: {e}") from None
    except RecursionError:
        raise GraphFormatError("graph JSON is nested too deeply to be read") from None
    return graph_from_dict(data, validate)
