"""What an op's output is made of (the SumKind column of a compare row): a sum of its inputs'
terms, the only outputs that cancellation can make small (root cause's cancellation rule),
or an exact selection of them, which rounds nothing of its own (root cause's gradual rule)."""
from __future__ import annotations

import re

# the ops whose output is a sum of terms of its inputs, and how their output is bounded
SUMS = frozenset({"Add", "AddV2", "Sub", "AddN", "BiasAdd", "BiasAddGrad", "ReduceSum",
                  "ReduceMean", "SumToLike"})
CONTRACTIONS = frozenset({"MatMul", "MatMulV2", "BatchMatMul", "BatchMatMulV2", "Conv2D",
                          "Conv2DBackpropInput", "Conv2DBackpropFilter"})
# ops whose output is its inputs' values, selected, masked or moved, in their own dtype: no
# rounding of their own in any precision (a ReLU's gradient is the incoming gradient where the
# saved activation is positive; a max pool picks an element)
EXACT = frozenset({"Relu", "ReluGrad", "MaxPool", "Maximum", "Minimum", "ClipByValue", "Neg",
                   "Abs", "Select", "Gather", "ConcatV2", "Pack", "Reshape", "Transpose",
                   "Identity"})
# a dumped API or module call (a script's, msprobe's: no kernel named) whose kernel rounds
# nothing, by the direction its name ends in: a ReLU both ways, a max pool forward (its
# backward sums the gradients of overlapping windows)
_RELU_CALLS = {"Functional.relu", "Functional.relu_", "Torch.relu", "Torch.relu_",
               "Tensor.relu", "Tensor.relu_", "Module.ReLU"}
EXACT_CALLS = {"forward": frozenset(_RELU_CALLS | {"Functional.max_pool2d", "Torch.max_pool2d",
                                                   "Module.MaxPool2d"}),
               "backward": frozenset(_RELU_CALLS)}
_DIRECTION = re.compile(r"\.(forward|backward)(?:\.\d+)?$")
SUM_STEPS = frozenset({"Add", "Sub", "Neg"})    # a fused elementwise chain's sum-only steps


def call_kind(op_type: str, op_name: str) -> str:
    """"exact" for a call whose kernel rounds nothing (EXACT_CALLS: Functional.relu.3.backward,
    msprobe's Module.layer1.0.relu.ReLU.forward.0), else ""."""
    m = _DIRECTION.search(op_name)
    return "exact" if m and op_type in EXACT_CALLS[m.group(1)] else ""


def sum_kind(op_type: str, attrs: dict, output: int) -> str:
    """"sum", "contraction", "exact" or "" for an op's output: whether cancellation can make
    it small, or whether it rounds nothing (the compare row's SumKind). A fused elementwise
    kernel's output is a sum only when every step it is computed through is one (a Mul
    inside makes it a product)."""
    if op_type in SUMS:
        return "sum"
    if op_type in CONTRACTIONS:
        return "contraction"
    if op_type in EXACT:
        return "exact"
    if op_type != "FusedEltwise":
        return ""
    roles, role_steps, steps = attrs.get("roles", []), attrs.get("role_steps", {}), attrs.get("steps", [])
    try:
        todo = [int(role_steps[roles[output]].split(":")[1])]
        seen = set()
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            if steps[k]["type"] not in SUM_STEPS:
                return ""
            todo += [int(r.split(":")[1]) for r in steps[k]["inputs"] if r.startswith("step:")]
    except (IndexError, KeyError, ValueError, TypeError, AttributeError):
        return ""              # a malformed record: never excuse
    return "sum"
