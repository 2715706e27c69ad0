"""Saving and loading graphs as JSON, checked against the op registry on load."""
from __future__ import annotations

from .errors import GraphFormatError
from .graph import Graph, graph_from_json, graph_to_json
from .fileio import write_text_atomic
from .ops.registry import validate_node


def save_graph(graph: Graph, path: str) -> None:
    """Write the graph's JSON atomically (the file appears whole or not at all)."""
    write_text_atomic(path, graph_to_json(graph) + "\n")


def load_graph(path: str) -> Graph:
    """Read a graph JSON; unknown op types, dangling inputs, cycles and outputs that do not
    follow from the inputs are rejected with the op named."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise GraphFormatError(f"cannot read graph file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise GraphFormatError(f"graph file {path} is not UTF-8 text") from None
    return graph_from_json(text, validate=validate_node)
