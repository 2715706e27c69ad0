"""An ONNX model into the graph IR, for inference, as ATC reads it: shapes fixed first (the batch,
and any other free dimension the caller names), then every value that does not depend on an
input folded to a constant (Shape, ConstantOfShape, the index arithmetic of exports, weights
re-laid out by Transpose or Cast), then one op, or a few, for each remaining node.

Names: an op keeps its ONNX node's name (a node's helper ops are named under it,
`<node>/<part>`), so that a user finds every dumped op in the model; `onnx_names` maps back.
Float initializers become variables, loaded with the model's values (`weights`); small folded
values become constants. A model with any op or attribute outside what the rules cover is
refused whole, naming every such op type with its count: never a partial graph.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import FeedError, GraphError, PrecisionToolError
from ..graph import Graph, Tensor, dtypes
from .. import ops

MIN_OPSET, MAX_OPSET = 13, 21
# a folded float constant this small is a Const op; larger ones are variables
CONST_LIMIT = 64


_REFUSED = object()     # the value of a node the rules refused (the import fails at the end)
_DOWNSTREAM = "downstream of a refused node"


def _kind(node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


class OnnxImportError(PrecisionToolError, ValueError):
    """The model cannot be read, or its inputs' shapes cannot be fixed as given."""


class UnsupportedModelError(OnnxImportError):
    """Ops or attributes the importer does not cover; `unsupported` maps each op type to
    (count, reason)."""

    def __init__(self, unsupported: Mapping[str, Tuple[int, str]]):
        self.unsupported = dict(unsupported)
        listed = ", ".join(f"{op} x{n}" + (f" ({why})" if why else "")
                           for op, (n, why) in sorted(self.unsupported.items()))
        super().__init__(f"the model uses {len(self.unsupported)} unsupported op type(s): {listed}")


class Unsupported(Exception):
    """Raised by a rule: this node, as configured, has no translation (the reason says why)."""


@dataclass
class ImportedModel:
    """graph: the IR; inputs / outputs: ONNX graph input and output names -> tensors;
    weights: variable name -> value (load them into each session: `load_weights`);
    onnx_names: op name -> the ONNX node it came from; tensors: ONNX value name -> tensor name,
    for every value computed at run time; folded: ONNX nodes folded into constants."""
    graph: Graph
    inputs: Dict[str, Tensor]
    outputs: Dict[str, Tensor]
    weights: Dict[str, np.ndarray] = field(default_factory=dict)
    onnx_names: Dict[str, str] = field(default_factory=dict)
    tensors: Dict[str, str] = field(default_factory=dict)
    folded: List[str] = field(default_factory=list)
    opset: int = 0
    path: Optional[str] = None
    proto: object = field(default=None, repr=False)     # the ModelProto, at opset >= 13

    def load_weights(self, session) -> None:
        """Give a session of this graph the model's weights (exactly: no rounding)."""
        session.load_variables(self.weights, exact=True)

    def feed_dict(self, feeds: Mapping[str, np.ndarray]) -> Dict[Tensor, np.ndarray]:
        """{input tensor: value} from ONNX input names, every model input given once."""
        unknown = sorted(set(feeds) - set(self.inputs))
        if unknown:
            raise FeedError(f"{', '.join(unknown)}: no such model input "
                            f"(inputs: {', '.join(self.inputs)})")
        missing = sorted(set(self.inputs) - set(feeds))
        if missing:
            raise FeedError(f"no data for input(s) {', '.join(missing)}")
        return {self.inputs[k]: v for k, v in feeds.items()}

    def random_feeds(self, seed: int = 0) -> Dict[Tensor, np.ndarray]:
        """Standard-normal float inputs and zero integer inputs of the fixed shapes."""
        rng = np.random.default_rng(seed)
        feeds = {}
        for t in self.inputs.values():
            np_dtype = dtypes.to_numpy(t.dtype)
            if np.dtype(np_dtype).kind == "f":
                feeds[t] = rng.standard_normal(t.shape).astype(np_dtype)
            else:
                feeds[t] = np.zeros(t.shape, np_dtype)
        return feeds


def _onnx():
    try:
        import onnx
    except ImportError:
        raise OnnxImportError("reading ONNX models needs the onnx package: "
                              "pip install 'precision_tool[onnx]'") from None
    return onnx


def read_model(source):
    """An onnx ModelProto from a path or a ModelProto, checked and at opset 13 or newer."""
    onnx = _onnx()
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise OnnxImportError(f"{path}: no such model file")
        try:
            model = onnx.load(path)
        except Exception as e:          # protobuf's DecodeError and friends: not ONNX
            raise OnnxImportError(f"{path}: not a readable ONNX model "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    else:
        model = source
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise OnnxImportError("the model imports no ai.onnx opset")
    if opset > MAX_OPSET:
        # the ops a model of a newer opset uses mostly mean what they meant at 21: onnx's
        # converter says where one does not
        model = _convert(model, opset, MAX_OPSET)
        opset = MAX_OPSET
    if opset < MIN_OPSET:
        # exports at opset 11 and 12 (Paddle's, older PyTorch) are common: onnx's own
        # converter brings them to 13, where the importer's rules are written
        model = _convert(model, opset, MIN_OPSET)
        opset = MIN_OPSET
    return model, opset


def _convert(model, opset: int, to: int):
    from onnx import version_converter
    try:
        return version_converter.convert_version(model, to)
    except Exception as e:
        raise OnnxImportError(f"opset {opset} is outside {MIN_OPSET} to {MAX_OPSET} and onnx's "
                              f"converter could not bring it to {to}: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


_BAD_NAME = re.compile(r"[:\s]+")


def op_name(onnx_name: str, fallback: str) -> str:
    """An op name for an ONNX node name: '/' keeps scoping (PyTorch's '/encoder/layer.0/...'
    loses its leading slash), ':' (our tensor separator) and blanks become '_'."""
    parts = [p for p in _BAD_NAME.sub("_", onnx_name or "").split("/") if p]
    return "/".join(parts) or fallback


class Context:
    """What a rule sees of one node: its attributes, and its inputs as tensors (`tensor(k)`)
    or, for those fixed at import time, as numpy values (`static(k)`)."""

    def __init__(self, importer: "_Importer", node):
        from onnx import helper
        self.node = node
        self.type = node.op_type
        self.attrs = {}
        for a in node.attribute:
            v = helper.get_attribute_value(a)
            self.attrs[a.name] = v.decode() if isinstance(v, bytes) else v
        self._imp = importer
        self.name = importer.unique_op_name(node)

    def has(self, k: int) -> bool:
        return k < len(self.node.input) and self.node.input[k] != ""

    @property
    def n_inputs(self) -> int:
        return len(self.node.input)

    def is_static(self, k: int) -> bool:
        return isinstance(self._imp.values[self.node.input[k]], np.ndarray)

    def static(self, k: int) -> np.ndarray:
        value = self._imp.values[self.node.input[k]]
        if not isinstance(value, np.ndarray):
            raise Unsupported(f"input {k} computed at run time (it must be a constant)")
        return value

    def tensor(self, k: int) -> Tensor:
        return self._imp.as_tensor(self.node.input[k])

    def shape(self, k: int) -> Tuple[int, ...]:
        value = self._imp.values[self.node.input[k]]
        return tuple(value.shape)

    def dtype(self, k: int) -> str:
        value = self._imp.values[self.node.input[k]]
        return str(value.dtype)

    def sub(self, part: str) -> str:
        """The name of a helper op of this node."""
        return f"{self.name}/{part}"

    def refuse(self, **allowed):
        """Refuse attribute values other than those given (what the op computes)."""
        for key, want in allowed.items():
            if key in self.attrs and self.attrs[key] != want:
                raise Unsupported(f"{key}={self.attrs[key]!r}")


class _Importer:
    def __init__(self, model, opset: int, fold: bool):
        self.model = model
        self.opset = opset
        self.fold = fold
        self.values: Dict[str, object] = {}      # ONNX value name -> np.ndarray | Tensor
        self.weights: Dict[str, np.ndarray] = {}
        self.onnx_names: Dict[str, str] = {}
        self.folded: List[str] = []
        self.graph: Optional[Graph] = None
        self._names_taken = set()

    def unique_op_name(self, node) -> str:
        base = op_name(node.name, node.op_type)
        name, k = base, 0
        while name in self._names_taken or name in self.graph:
            k += 1
            name = f"{base}_{k}"
        self._names_taken.add(name)
        return name

    def as_tensor(self, value_name: str) -> Tensor:
        value = self.values[value_name]
        if isinstance(value, Tensor):
            return value
        arr = value
        if str(arr.dtype) not in dtypes.ALL_DTYPES:
            raise Unsupported(f"{arr.dtype} tensors")
        name = op_name(value_name, "Const")
        if arr.dtype.kind == "f" and arr.size > CONST_LIMIT:
            name = self._free(name)
            t = ops.variable(name, list(arr.shape), init="zeros", dtype=str(arr.dtype),
                             trainable=False)
            self.weights[t.op.name] = arr
        else:
            t = ops.constant(arr, dtype=str(arr.dtype), name=self._free(name))
        self.values[value_name] = t          # materialised once, shared by every reader
        return t

    def add(self, node, rules) -> Optional[str]:
        """Translate one node (or fold it); the reason when it cannot be, else None."""
        values = [self.values.get(n) if n else None for n in node.input]
        missing = [n for n, v in zip(node.input, values) if n and v is None]
        if missing:
            raise OnnxImportError(f"node {node.name or node.op_type} reads {missing[0]!r}, "
                                  f"which no earlier node makes (the graph is not sorted)")
        if _kind(node) != node.op_type:
            return "a custom domain"
        if any(v is _REFUSED for v in values):
            return _DOWNSTREAM
        if self.fold and all(v is None or isinstance(v, np.ndarray) for v in values):
            try:
                outs = _fold(node, values, self.model.opset_import)
            except Exception as e:
                # onnx's reference kernels miss cases (GatherElements along the last axis
                # fails in onnx 1.23): then our own kernels compute the node at run time
                if node.op_type not in rules:
                    return (f"its inputs are constants that onnx's reference evaluator could "
                            f"not fold ({type(e).__name__}: {e})")
            else:
                self.values.update(zip(node.output, outs))
                self.folded.append(node.name or node.op_type)
                return None
        if node.op_type not in rules:
            return ""
        ctx = Context(self, node)
        try:
            outs = rules[node.op_type](ctx)
        except (Unsupported, GraphError) as e:
            # GraphError: an op of ours refused what the rule built (a dtype, a shape)
            return str(e)
        self.values.update((name, value) for name, value in zip(node.output, outs) if name)
        if all(isinstance(v, np.ndarray) for v in outs):
            self.folded.append(node.name or node.op_type)   # Shape of a run-time value
        else:
            self.onnx_names[ctx.name] = node.name or ctx.name
        return None

    def _free(self, name: str) -> str:
        """A name no op holds and no node has reserved."""
        free, k = self.graph.unique_name(name), 0
        while free in self._names_taken:
            k += 1
            free = self.graph.unique_name(f"{name}_{k}")
        self._names_taken.add(free)
        return free


def _fold(node, inputs: List[np.ndarray], opsets) -> List[np.ndarray]:
    """Evaluate one node on constant inputs with onnx's reference implementation."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    names = [f"in{k}" if n else "" for k, n in enumerate(node.input)]
    outs = [f"out{k}" for k in range(len(node.output))]
    one = helper.make_node(node.op_type, names, outs, domain=node.domain)
    one.attribute.extend(node.attribute)
    feeds = {n: v for n, v in zip(names, inputs) if n}
    graph = helper.make_graph([one], "fold", [], [helper.make_tensor_value_info(o, 0, None)
                                                    for o in outs])
    model = helper.make_model(graph, opset_imports=opsets)
    results = ReferenceEvaluator(model).run(None, feeds)
    return [np.asarray(r) for r in results]


def _input_shapes(model, batch: Optional[int], shapes: Mapping[str, Sequence[int]], inits):
    """Every graph input's fixed shape and dtype; an error names each dimension left free."""
    from onnx import helper
    fixed, free = {}, []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = str(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if vi.name in shapes:
            fixed[vi.name] = (tuple(int(d) for d in shapes[vi.name]), dtype)
            continue
        dims = []
        for k, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            elif k == 0:
                dims.append(int(batch or 1))   # the batch: what --batch says, else 1
            else:
                free.append(f"{vi.name}[{k}] ({d.dim_param or '?'})")
                dims.append(None)
        fixed[vi.name] = (tuple(dims), dtype)
    odd = {f"{dt} input": (1, k) for k, (_, dt) in fixed.items() if dt not in dtypes.ALL_DTYPES}
    if odd:
        raise UnsupportedModelError(odd)
    if free:
        raise OnnxImportError(f"input dimension(s) {', '.join(free)} have no size: give the "
                              f"input's shape (--shape NAME=1,3,224,224) or data "
                              f"(--input NAME=FILE.npy)")
    return fixed


def load(source, batch: Optional[int] = None, shapes: Optional[Mapping[str, Sequence[int]]] = None,
         constants: Optional[Mapping[str, np.ndarray]] = None, fold: bool = True,
         name: Optional[str] = None) -> ImportedModel:
    """An ONNX model (a path or ModelProto; opsets 13 to 21, others through onnx's version
    converter) as an inference graph. batch fixes a free first dimension of every input (default 1); shapes
    fixes whole input shapes by name; constants gives inputs fixed values (they become
    constants, as ATC's fixed inputs). fold=False keeps every node an op (tests use it to run
    each rule on its own)."""
    from onnx import numpy_helper
    from .converters import RULES
    model, opset = read_model(source)
    shapes = dict(shapes or {})
    constants = {k: np.asarray(v) for k, v in (constants or {}).items()}
    inits = {i.name: i for i in model.graph.initializer}
    unknown = sorted(set(shapes) - {vi.name for vi in model.graph.input})
    if unknown:
        raise OnnxImportError(f"the model has no input named {', '.join(unknown)} "
                              f"(inputs: {', '.join(vi.name for vi in model.graph.input if vi.name not in inits)})")

    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    graph_name = name or op_name(model.graph.name, "") or (
        os.path.splitext(os.path.basename(path))[0] if path else "onnx_model")
    imp = _Importer(model, opset, fold)
    imp.graph = g = Graph(op_name(graph_name, "onnx_model"))
    inputs = {}
    with g.as_default():
        for init in model.graph.initializer:
            imp.values[init.name] = numpy_helper.to_array(init)
        for input_name, (shape, dtype) in _input_shapes(
                model, batch, {k: v for k, v in shapes.items() if k not in constants},
                {**inits, **constants}).items():
            t = ops.placeholder(imp._free(op_name(input_name, "input")), list(shape), dtype)
            imp.values[input_name] = t
            inputs[input_name] = t
        imp.values.update(constants)
        # every node is tried, so that one error lists all that is missing; a node whose
        # inputs are known at import time folds whatever its type (exports compute masks and
        # shapes with ops that never run on the device)
        refused: Dict[str, List] = {}            # op type -> [count, first reason]
        for node in model.graph.node:
            why = imp.add(node, RULES)
            if why is None:
                continue
            imp.values.update((o, _REFUSED) for o in node.output)
            kind = _kind(node)
            if why == _DOWNSTREAM:
                if kind in RULES:
                    continue                     # its own type may be fine: not counted
                why = ""
            refused.setdefault(kind, [0, why])[0] += 1
        if refused:
            raise UnsupportedModelError({op: tuple(v) for op, v in refused.items()})
        try:
            outputs = {o.name: imp.as_tensor(o.name) for o in model.graph.output}
        except Unsupported as e:
            raise UnsupportedModelError({"model output": (1, str(e))}) from None
    tensors = {k: v.name for k, v in imp.values.items() if isinstance(v, Tensor)}
    return ImportedModel(graph=g, inputs=inputs, outputs=outputs, weights=imp.weights,
                         onnx_names=imp.onnx_names, tensors=tensors, folded=imp.folded,
                         opset=opset, path=path, proto=model)
