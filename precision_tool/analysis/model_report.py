"""What the `onnx` job found: an imported model run once on the golden executor and the
simulated NPU (onnx.job.dump_model), its outputs judged as vc judges a tensor, and, when
asked, the golden executor against ONNX Runtime node by node."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional

import numpy as np

from ..table import Table
from .comparing.metrics import compare_tensors
from .comparing.verdicts import judge


@dataclass
class OutputVerdict:
    """A model output: the NPU's value against the golden's, its cosine and max |error|
    (compare_tensors: over the finite pairs, note saying what was left out), and the verdict
    of the default criteria with what decided it."""
    name: str
    shape: List[int]
    cosine: float
    max_abs_error: float
    note: str
    verdict: str
    reason: str


def judge_outputs(pairs: Mapping[str, tuple],
                  device_dtypes: Optional[Mapping[str, str]] = None) -> List[OutputVerdict]:
    """Each output's (golden, NPU) values compared and judged by the default criteria, as
    the dtype the device made it in (device_dtypes; else the NPU value's own): an fp16
    softmax's output fetched as float32 still flushed in fp16."""
    rows, metrics = [], []
    for name, (golden, npu) in pairs.items():
        m = compare_tensors(npu, golden)
        finite = np.abs(np.asarray(golden, dtype=np.float64))
        finite = finite[np.isfinite(finite)]
        dtype = (device_dtypes or {}).get(name) or np.asarray(npu).dtype.name
        rows.append(dict(m, Elements=float(np.size(golden)), NpuDataType=dtype,
                         GoldenAbsMax=float(finite.max()) if finite.size else float("nan")))
        metrics.append((name, list(np.shape(golden)), m))
    if not rows:
        return []
    table = Table({k: np.array([r[k] for r in rows],
                               dtype=object if isinstance(rows[0][k], str) else float)
                   for k in rows[0]})
    judged = judge(table)
    return [OutputVerdict(name, shape, m["CosineSimilarity"], m["MaxAbsoluteError"],
                          m["CompareFailReason"], str(verdict), str(reason or ""))
            for (name, shape, m), verdict, reason in zip(metrics, judged["Verdict"],
                                                          judged["Reason"])]


@dataclass
class ModelReport:
    """The `onnx` job's result: the model and its import (opset, ops, folded nodes, weights,
    inputs' shapes, the inputs generated for want of data), the runs written (labels), the
    NPU's status word, each output's verdict, and the golden against ONNX Runtime (nodes
    compared, those over 1e-5 relative error, the worst) when a reference was asked."""
    model: str
    opset: int
    ops: int
    folded: int
    weights: int
    inputs: Dict[str, List[int]]
    generated_inputs: List[str]
    precision_mode: str
    npu_run: str
    golden_run: str
    reference_run: Optional[str]
    float_status: int
    outputs: List[OutputVerdict]
    reference: Optional[dict] = None

    @property
    def diverging(self) -> List[str]:
        """The outputs that do not pass (an output that could not be compared aside)."""
        return [o.name for o in self.outputs if o.verdict not in ("pass", "error")]

    def to_dict(self) -> dict:
        return asdict(self)


def _label(run_dir: str) -> str:
    return "/".join(os.path.normpath(run_dir).split(os.sep)[-2:])


def model_report(model: str, imported, result, given: List[str],
                 precision_mode: str) -> ModelReport:
    """The report of dump_model's `result` for the imported model; given: the inputs the
    user gave data for."""
    n_ops = sum(1 for n in imported.graph.nodes
                if n.type not in ("Placeholder", "Variable", "Const"))
    reference = None
    if result.reference_run:
        worst = max(result.reference, key=lambda d: d.rel_l2, default=None)
        reference = {"nodes": len(result.reference),
                     "over_1e-5": sum(1 for d in result.reference if d.rel_l2 > 1e-5),
                     "worst": None if worst is None else {
                         "node": worst.name, "rel_l2": worst.rel_l2, "max_abs": worst.max_abs}}
    return ModelReport(model, imported.opset, n_ops, len(imported.folded), len(imported.weights),
                       {k: list(t.shape) for k, t in imported.inputs.items()},
                       sorted(set(imported.inputs) - set(given)), precision_mode,
                       _label(result.npu_run), _label(result.golden_run),
                       _label(result.reference_run) if result.reference_run else None,
                       result.float_status, judge_outputs(result.outputs, result.device_dtypes),
                       reference)
