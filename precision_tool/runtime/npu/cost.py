"""A step-time model of the simulated NPU, for comparing two compilations of one graph (what a
precision fix costs): the simulator computes in numpy, so its own wall time says nothing of a
device's. The model is a roofline per kernel with nominal Ascend 910-class rates:

- a cube kernel (MatMul, Conv2D...) does 2 * output elements * K flops, K the contraction
  length (the square root of its two inputs' elements over its output's: exact for matrix
  products, an estimate for convolutions), at 256 TFLOPS in fp16/bf16 and a quarter of that
  in fp32;
- a vector kernel does one operation per output element, at 8 T elements/s in fp16/bf16 and
  half that in fp32 (a vector instruction holds twice as many fp16 lanes);
- every kernel moves its inputs and outputs through 1.2 TB/s of memory, and costs 3 us to
  launch; its time is the largest of compute and memory, plus the launch.

Dimensions the graph leaves open (the batch) take the value the step was fed with. The
figures are a model, not a measurement: a ratio of two estimates is what they are for.
"""
from __future__ import annotations

import math
from typing import Optional

from ...errors import GraphError
from ...graph import NOT_KERNELS, Graph, dtypes, split_tensor_name
from ...ops import REGISTRY, registry

CUBE_FLOPS = {"float16": 256e12, "bfloat16": 256e12, "float32": 64e12}
VECTOR_OPS = {"float16": 8e12, "bfloat16": 8e12, "float32": 4e12}
BANDWIDTH = 1.2e12            # bytes per second
LAUNCH = 3e-6                 # seconds per kernel


def _elements(shape, open_dim: int) -> int:
    return math.prod(open_dim if d is None else d for d in shape)


def _itemsize(dtype: str) -> int:
    try:
        return dtypes.to_numpy(dtype).itemsize
    except GraphError:       # a type this build does not know: count 4 bytes
        return 4


def kernel_seconds(graph: Graph, node, open_dim: int) -> float:
    """The modelled time of one compiled kernel (see the module doc)."""
    specs = []
    for name in node.inputs:
        producer, k = split_tensor_name(name)
        if producer in graph:
            outs = graph.node(producer).outputs
            if k < len(outs):
                specs.append(outs[k])
    out = sum(_elements(s.shape, open_dim) for s in node.outputs)
    moved = sum(_elements(s.shape, open_dim) * _itemsize(s.dtype) for s in specs + list(node.outputs))
    compute = node.attrs.get("compute_dtype") or (node.outputs[0].dtype if node.outputs else "float32")
    compute = compute if compute in CUBE_FLOPS else "float32"
    op = REGISTRY.get(node.type)
    if op is not None and op.unit == registry.CUBE and len(specs) >= 2 and out:
        k = math.sqrt(_elements(specs[0].shape, open_dim) * _elements(specs[1].shape, open_dim) / out)
        work = 2.0 * out * k / CUBE_FLOPS[compute]
    else:
        work = out / VECTOR_OPS[compute]
    return LAUNCH + max(work, moved / BANDWIDTH)


def step_seconds(graph: Graph, open_dim: Optional[int] = None) -> float:
    """The modelled time of one step of a compiled graph: the sum over its kernels."""
    dim = open_dim or 1
    return sum(kernel_seconds(graph, n, dim) for n in graph.nodes if n.type not in NOT_KERNELS)

