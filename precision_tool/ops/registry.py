"""The op registry: one small declarative entry per op type.

An entry gives the op's shape/dtype rule, its reference kernel (computes in the dtype of its
inputs, so the same kernel serves the fp32 and the fp64 golden run), its gradient rule (builds
gradient ops into the graph) and the compute unit that runs it on an NPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import GraphError, GraphFormatError
from .. import kernels, numerics
from ..graph import Tensor, TensorSpec, dtypes, get_default_graph
from ..graph.ir import Node

CUBE, VECTOR, AICPU = "cube", "vector", "aicpu"


@dataclass(frozen=True)
class OpDef:
    type: str
    infer: Callable[[List[TensorSpec], Dict[str, Any], str], List[TensorSpec]]
    kernel: Optional[Callable]          # kernel(inputs, attrs, ctx) -> array | list of arrays
    grad: Optional[Callable] = None     # grad(GradContext) -> list of input grads (Tensor | None)
    unit: str = VECTOR
    updates: Sequence[int] = ()         # output i overwrites the variable at input updates[i]
    min_inputs: int = 0
    max_inputs: Optional[int] = None    # None: same as min_inputs; -1: unbounded
    doc: str = ""
    constant: bool = False              # pure function of attrs: executors may cache it
    attrs: Dict[str, Any] = field(default_factory=dict)  # defaults, filled in at build time
    shape_inputs: Sequence[int] = ()    # inputs read for their shape only (never cast)
    five_hd: Tuple[Sequence[int], Sequence[int]] = ((), ())  # (inputs, outputs) in NC1HWC0 on an NPU
    gated: bool = False                 # an update op: an optional last bool input skips it


REGISTRY: Dict[str, OpDef] = {}


def register(type: str, **kw) -> OpDef:
    if type in REGISTRY:
        raise RuntimeError(f"op type {type} registered twice")
    op = OpDef(type=type, **kw)
    REGISTRY[type] = op
    return op


def get(type: str) -> OpDef:
    try:
        return REGISTRY[type]
    except KeyError:
        raise GraphError(f"unknown op type {type!r}") from None


def updated_inputs(type: str) -> Sequence[int]:
    """The inputs an op type overwrites (an optimizer update, an assignment); () for a type
    this build does not know, as a dump from elsewhere may name, but for a PyTorch API
    call in place (`Tensor.lerp_`, `Tensor.__iadd__`: PyTorch's convention), which
    overwrites its tensor."""
    op = REGISTRY.get(type)
    if op is not None:
        return op.updates
    if type.startswith("Tensor.") and (type.endswith("_") and not type.endswith("__") or
                                       type[len("Tensor."):] in _IN_PLACE_OPERATORS):
        return (0,)
    return ()


_IN_PLACE_OPERATORS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
    "rshift", "matmul"))


def _check_arity(op: OpDef, n: int, where: str):
    hi = op.min_inputs if op.max_inputs is None else op.max_inputs
    if n < op.min_inputs or (hi != -1 and n > hi):
        want = str(op.min_inputs) if hi == op.min_inputs else (
            f"at least {op.min_inputs}" if hi == -1 else f"{op.min_inputs} to {hi}")
        raise GraphError(f"{where}: takes {want} inputs, got {n}")


# A node attribute any op may carry: compute in the graph's declared dtype whatever the NPU
# precision policy (loss-scale bookkeeping is fp32 on the device).
KEEP_DTYPE = "keep_dtype"


def make(type: str, inputs: Sequence, attrs: Optional[Dict[str, Any]] = None,
         name: Optional[str] = None, graph=None) -> Node:
    """Add a node of `type` to the default graph after checking it with the op's rule."""
    op = get(type)
    graph = graph or _graph_of(inputs)
    tensors = [_as_tensor(x, graph) for x in inputs]
    full_attrs = dict(op.attrs)
    full_attrs.update({k: v for k, v in (attrs or {}).items() if v is not None})
    where = f"{type} {graph.current_scope + '/' if graph.current_scope else ''}{name or type}"
    _check_arity(op, len(tensors), where)
    for pos in op.updates:
        if tensors[pos].node.type != "Variable":
            raise GraphError(f"{where}: input {pos} must be a variable (it is updated in "
                             f"place), got {tensors[pos].node.type} {tensors[pos].name!r}")
    outputs = op.infer([t.spec for t in tensors], full_attrs, where)
    return graph.add_node(type, tensors, full_attrs, outputs, name=name)


def _graph_of(inputs):
    for x in inputs:
        if isinstance(x, Tensor):
            return x.graph
        if isinstance(x, Node):
            return x.graph
    return get_default_graph()


def _as_tensor(x, graph) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Node):
        if not x.outputs:
            raise GraphError(f"op {x.name!r} has no outputs to use as an input")
        return x.output(0)
    raise GraphError(f"expected a tensor, got {type(x).__name__}: {x!r}")


def validate_node(node: Node) -> None:
    """Check a loaded node against the registry: known type, arity, and the stored output specs."""
    try:
        op = get(node.type)
    except GraphError:
        raise GraphFormatError(f"op {node.name!r} has unknown type {node.type!r}") from None
    where = f"{node.type} {node.name}"
    try:
        _check_arity(op, len(node.inputs), where)
        specs = [node.graph.tensor(i).spec for i in node.inputs]
        full_attrs = dict(op.attrs)
        full_attrs.update(node.attrs)
        inferred = op.infer(specs, full_attrs, where)
    except GraphError as e:
        raise GraphFormatError(f"op {node.name!r} is inconsistent: {e}") from None
    if [tuple(s.shape) for s in inferred] != [tuple(s.shape) for s in node.outputs] or \
            [s.dtype for s in inferred] != [s.dtype for s in node.outputs]:
        raise GraphFormatError(
            f"op {node.name!r} ({node.type}) declares outputs "
            f"{[str(s) for s in node.outputs]} but its inputs give {[str(s) for s in inferred]}")


class KernelContext:
    """What a kernel may ask of the executor besides its inputs and attributes.

    The CPU golden executor computes every float op in its golden dtype; the simulated NPU
    computes in fp32, sets `low` for an op that computes in fp16/bf16 and collects overflow
    status. Fused kernels round their inner steps with `round`, a no-op unless `low` is set.
    """

    def __init__(self, float_dtype=np.float32, step: int = 0, graph_seed: int = 0,
                 saturation: bool = False, device: bool = False):
        self.float_dtype = np.dtype(float_dtype)
        self.step = step
        self.graph_seed = graph_seed
        self.low: Optional[str] = None   # "float16"/"bfloat16" when the op computes below fp32
        self.saturation = saturation
        # the simulated NPU's context: inner fp32 steps of fused kernels overflow as the
        # device's do (status word, saturation); the golden's leaves them as numpy makes them
        self.device = device
        self.float_status = 0       # OR of the status words of the kernels run so far this step
        self.run_status = 0         # ... and of every kernel of the run, whatever clears the above
        self.status = 0             # the current kernel's own status word
        self.kernel_inputs = ()     # the current kernel's inputs (set by the executor)

    def rng(self, seed: int) -> np.random.Generator:
        """A generator fixed by (graph seed, op seed, step): reproducible, new every step."""
        return np.random.Generator(np.random.PCG64([self.graph_seed, int(seed), self.step]))

    def resolve_dtype(self, name: str) -> np.dtype:
        """The numpy dtype an IR dtype runs as: float types run as the golden float dtype."""
        return self.float_dtype if dtypes.is_float(name) else dtypes.to_numpy(name)

    def round(self, x: np.ndarray) -> np.ndarray:
        """An inner step of a fused kernel: round to the compute dtype (recording overflow and
        saturating as the hardware does), and continue in the run dtype."""
        if self.low is None:
            return self.inner(x)
        low, overflowed = kernels.round_result(x, self.low, self.saturation)
        # born in this kernel when its inputs were finite, even where the fp32 step itself
        # already overflowed to inf (an exp of a logit over 88.7 inside a fused fp16 softmax:
        # saturation then hides it in the output, and only this bit tells)
        if overflowed and all_finite(self.kernel_inputs):
            self.status |= numerics.STATUS_FLOAT_OVERFLOW
        return low


    def inner(self, x: np.ndarray) -> np.ndarray:
        """An inner step a fused kernel computes in fp32 (its unified buffer): on the device,
        an fp32 overflow there from finite inputs sets the status word and, in saturation
        mode, saturates at the fp32 maximum, however finite the kernel's output comes out
        (exp(100) inside a fused elementwise chain that then divides by it). Off the device
        (the golden), the value as numpy made it."""
        if not self.device or getattr(x, "dtype", None) != np.float32:
            return x
        out, overflowed = kernels.round_result(x, "float32", self.saturation)
        if overflowed and all_finite(self.kernel_inputs):
            self.status |= numerics.STATUS_FLOAT_OVERFLOW
        return out


def all_finite(arrays) -> bool:
    """Whether no float array among these holds nan or inf (what a kernel's status word asks
    of its inputs: an overflow is the kernel's own only when they were finite)."""
    return all(not (x.dtype.kind in "fV" and x.size) or np.isfinite(x).all() for x in arrays)


@dataclass
class GradContext:
    node: Node
    dys: List[Optional[Tensor]]   # gradient of each output, None where nothing flows back

    @property
    def dy(self) -> Optional[Tensor]:
        return self.dys[0]

    @property
    def x(self) -> List[Tensor]:
        return self.node.input_tensors

    @property
    def y(self) -> List[Tensor]:
        return [self.node.output(i) for i in range(len(self.node.outputs))]

    @property
    def attrs(self) -> Dict[str, Any]:
        return self.node.attrs
