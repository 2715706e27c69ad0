"""An imported model run as msit's compare runs one: the golden executor (the CPU side) and the
simulated NPU after an ATC-like compile (fusion, 5HD, the precision mode: force_fp16 by
default, as ATC's), both dumped as step 0 into a workspace on which every analysis command
works; optionally ONNX Runtime's value of every node dumped as a second reference run."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

import numpy as np

from ..dump import hooks
from ..runtime import Session, SessionConfig
from .importer import ImportedModel

ATC_DEFAULT_MODE = "force_fp16"
REFERENCES = ("onnxruntime",)


@dataclass
class ModelRun:
    """npu_run / golden_run / reference_run: the run directories written. outputs: each model
    output's (golden, NPU) values. reference: the golden executor against ONNX Runtime, node
    by node (reference.NodeDiff), when asked. float_status: the NPU's status word."""
    npu_run: str
    golden_run: str
    reference_run: Optional[str]
    outputs: Dict[str, tuple]
    float_status: int
    reference: List = field(default_factory=list)


def _substitute(imported: ImportedModel, values: Mapping[str, np.ndarray]) -> dict:
    """Session.run's substitute handing ORT's values to the ops that compute the same ONNX
    values (inputs, weights and constants are the model's own already)."""
    graph = imported.graph
    out: Dict[str, Dict[int, np.ndarray]] = {}
    for onnx_name, value in values.items():
        tensor = imported.tensors.get(onnx_name)
        if tensor is None:
            continue
        op, _, k = tensor.rpartition(":")
        if graph.node(op).type in ("Placeholder", "Variable", "Const"):
            continue
        out.setdefault(op, {})[int(k)] = value
    return out


def dump_model(imported: ImportedModel, root: str, feeds: Mapping[str, np.ndarray],
               precision_mode: str = ATC_DEFAULT_MODE, overflow_mode: str = "saturation",
               fusion_switch=None, modify_mixlist=None, reference: Optional[str] = None,
               progress=None) -> ModelRun:
    """Run the model once on the golden executor and on the simulated NPU, both dumped
    (step 0; the NPU with its overflow check) into the workspace at root. reference
    'onnxruntime' also dumps ORT's node values as a cpu run marked values_from. feeds:
    ONNX input name -> array. fusion_switch: None (every pass), "off", a fusion_switch.cfg
    dict or path; modify_mixlist: a dict or JSON path, as ATC's --modify_mixlist (what `fix`
    writes). progress(text) hears what is running."""
    say = progress or (lambda text: None)
    fed = imported.feed_dict(feeds)
    fetches = list(imported.outputs.values())
    if reference is not None and reference not in REFERENCES:
        raise ValueError(f"reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
    cfg = SessionConfig(precision_mode=precision_mode, overflow_mode=overflow_mode,
                        modify_mixlist=modify_mixlist, fusion_switch=fusion_switch)
    diffs, reference_run = [], None
    if reference:
        from .reference import against_onnxruntime
        say("running the model on ONNX Runtime (every node's output)...")
        ort_values, diffs = against_onnxruntime(imported, feeds)
        ref = Session(imported.graph)
        imported.load_weights(ref)
        hooks.attach_dump(ref, action="dump", dump_step="0", data_dir=root,
                          values_from=reference)
        ref.run(fetches, fed, substitute=_substitute(imported, ort_values))
        ref.close()
        (reference_run,) = hooks.dump_dirs(ref)
    say("running the model on the golden executor...")
    golden = hooks.sess_dump(Session(imported.graph), action="dump", dump_step="0",
                             data_dir=root)
    imported.load_weights(golden)
    golden_out = golden.run(fetches, fed)
    golden.close()
    say(f"compiling for the simulated NPU ({precision_mode}) and running it...")
    npu = Session(imported.graph, target="npu",
                  config=hooks.session_dump_config(cfg, action="dump|overflow", dump_step="0",
                                                   data_dir=root))
    imported.load_weights(npu)
    npu_out = npu.run(fetches, fed)
    status = npu.float_status()
    npu.close()
    outputs = {name: (g, n) for name, g, n in zip(imported.outputs, golden_out, npu_out)}
    return ModelRun(npu_run=hooks.dump_dirs(npu)[0], golden_run=hooks.dump_dirs(golden)[0],
                    reference_run=reference_run, outputs=outputs, float_status=status,
                    reference=diffs)
