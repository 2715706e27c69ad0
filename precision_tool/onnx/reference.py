"""ONNX Runtime as a second, independent reference (optional: `pip install onnxruntime`).

`node_outputs` runs the model on ORT's CPU provider with every node output made a graph
output (graph optimisations off, so that each value is the node's own), at the input shapes
the import fixed. `compare_nodes` sets them beside the golden executor's values of the same
ONNX names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping

import numpy as np

from .importer import ImportedModel, OnnxImportError


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise OnnxImportError("--reference onnxruntime needs ONNX Runtime: "
                              "pip install onnxruntime") from None
    return onnxruntime


def node_outputs(imported: ImportedModel, feeds: Mapping[str, np.ndarray],
                 names=None) -> Dict[str, np.ndarray]:
    """ONNX value name -> ORT's value, for the values the golden run computes (or `names`)."""
    ort = _ort()
    from onnx import helper
    model = type(imported.proto)()
    model.CopyFrom(imported.proto)
    wanted = list(names if names is not None else imported.tensors)
    present = {o.name for o in model.graph.output}
    known = {vi.name for vi in model.graph.input} | {i.name for i in model.graph.initializer}
    produced = {o for n in model.graph.node for o in n.output if o}
    for name in wanted:
        if name not in present and name in produced and name not in known:
            model.graph.output.append(helper.ValueInfoProto(name=name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    outs = [o.name for o in session.get_outputs()]
    # copied while the session lives: ORT's arrays view memory it owns (a capsule as their
    # base), and an output it aliases (a Reshape's) was found half zeroed after the run
    got = {name: np.array(v, copy=True) for name, v in zip(outs, session.run(outs, dict(feeds)))}
    return {k: got[k] for k in wanted if k in got}


@dataclass(frozen=True)
class NodeDiff:
    """One ONNX value. rel_l2: ||golden - ORT|| / ||ORT|| over the finite elements (0 when ORT's
    are all zero and golden's equal them; inf on a shape or integer mismatch): the relative
    error of the tensor, which a value near zero does not blow up. max_abs: the largest
    elementwise |golden - ORT|; max_rel: max_abs / max|ORT|. same_nonfinite: both hold
    inf/nan at the same places."""
    name: str
    shape: tuple
    rel_l2: float
    max_abs: float
    max_rel: float
    same_nonfinite: bool


def compare_nodes(golden: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> List[NodeDiff]:
    """Every value both runs hold, float values only (integer values must be equal: a
    mismatch there is reported with an infinite error)."""
    diffs = []
    for name, ref in reference.items():
        if name not in golden:
            continue
        got = np.asarray(golden[name])
        ref = np.asarray(ref)
        if got.shape != ref.shape:
            inf = float("inf")
            diffs.append(NodeDiff(name, tuple(ref.shape), inf, inf, inf, False))
            continue
        if ref.dtype.kind not in "fc":
            same = np.array_equal(got, ref)
            err = 0.0 if same else float("inf")
            diffs.append(NodeDiff(name, tuple(ref.shape), err, err, err, same))
            continue
        g64, r64 = got.astype(np.float64), ref.astype(np.float64)
        fin_g, fin_r = np.isfinite(g64), np.isfinite(r64)
        same_nf = bool(np.array_equal(fin_g, fin_r) and np.array_equal(g64[~fin_g], r64[~fin_r],
                                                                        equal_nan=True))
        both = fin_g & fin_r
        if both.any():
            abs_err = np.abs(g64[both] - r64[both])
            max_abs = float(abs_err.max())
            # relative to the tensor's scale: an element near zero in a tensor of large values
            # is judged against the values around it, as allclose's atol does
            scale = max(float(np.abs(r64[both]).max()), 1e-6)
            max_rel = max_abs / scale
            norm = float(np.linalg.norm(r64[both]))
            err = float(np.linalg.norm(g64[both] - r64[both]))
            rel_l2 = err / norm if norm else (0.0 if err == 0 else float("inf"))
        else:
            rel_l2 = max_abs = max_rel = 0.0
        diffs.append(NodeDiff(name, tuple(ref.shape), rel_l2, max_abs, max_rel, same_nf))
    return diffs


def golden_values(imported: ImportedModel, feeds: Mapping[str, np.ndarray],
                  names) -> Dict[str, np.ndarray]:
    """The golden executor's value of each ONNX value named (an undumped session); feeds:
    ONNX input name -> array."""
    from ..runtime import Session
    sess = Session(imported.graph)
    imported.load_weights(sess)
    return dict(zip(names, sess.run([imported.tensors[k] for k in names],
                                    imported.feed_dict(feeds))))


def against_onnxruntime(imported: ImportedModel, feeds: Mapping[str, np.ndarray]):
    """(ORT's value of every node, the golden executor against it node by node)."""
    ort_values = node_outputs(imported, feeds)
    return ort_values, compare_nodes(golden_values(imported, feeds, list(ort_values)),
                                     ort_values)
