"""The IR layer: graphs, nodes, tensor specs, topological order, JSON (de)serialisation."""
from . import dtypes
from .ir import (NOT_KERNELS, Graph, Node, Tensor, TensorSpec, format_shape,
                 get_default_graph, split_tensor_name)
from .serialize import (GraphView, NodeView, graph_from_dict, graph_from_json, graph_to_dict,
                        graph_to_json)

__all__ = ["NOT_KERNELS", "Graph", "Node", "Tensor", "TensorSpec", "dtypes", "format_shape", "get_default_graph",
           "split_tensor_name", "graph_from_dict", "graph_from_json", "graph_to_dict",
           "graph_to_json", "GraphView", "NodeView"]
