"""An imported model run as msit's compare runs one: the golden executor (the CPU side) and the
simulated NPU after an ATC-like compile (fusion, 5HD, the precision mode: force_fp16 by
default, as ATC's), both dumped as step 0 into a workspace on which every analysis command
works; optionally ONNX Runtime's value of every node written as a second reference run."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

import numpy as np

from ..dump import hooks, layout
from ..dump.runwriter import Record, RunWriter, op_spec
from ..runtime import Session, SessionConfig
from ..errors import GraphError
from .importer import ImportedModel

ATC_DEFAULT_MODE = "force_fp16"
REFERENCES = ("onnxruntime",)


@dataclass
class ModelRun:
    """npu_run / golden_run / reference_run: the run directories written. outputs: each model
    output's (golden, NPU) values. reference: the golden executor against ONNX Runtime, node
    by node (reference.NodeDiff), when asked. float_status: the NPU's status word.
    device_dtypes: the dtype each output has on the device (fp16 where the kernel that made
    it computed in fp16, whatever dtype the fetch hands back)."""
    npu_run: str
    golden_run: str
    reference_run: Optional[str]
    outputs: Dict[str, tuple]
    float_status: int
    reference: List = field(default_factory=list)
    device_dtypes: Dict[str, str] = field(default_factory=dict)


def write_reference_run(imported: ImportedModel, root: str, feeds: Mapping[str, np.ndarray],
                        values: Mapping[str, np.ndarray], source: str) -> str:
    """Write another executor's values of the model's ONNX values (ONNX Runtime's) as a
    reference run (step 0, golden layout, run.json's values_from naming the source): the
    feeds, the model's weights and constants, and every op whose outputs are all values the
    source computed. A node's helper ops (`<node>/<part>`) have no value there and are not
    written, nor their readers' input rows: the run holds what the source computed and
    nothing made up. Returns the run's directory."""
    from ..ops.array_ops import decode_value
    graph = imported.graph
    tensor_onnx = {tensor: name for name, tensor in imported.tensors.items()}
    given = {t.name: np.asarray(feeds[name]) for name, t in imported.inputs.items()}
    writer = RunWriter(root, layout.GOLDEN, {
        "graph": graph.name, "seed": graph.seed, "actions": ["dump"], "dump_step": [0],
        "dump_mode": "all", "dump_data": "tensor", "replay_of": None, "values_from": source})
    stamp = int(time.time() * 1e6)
    have: Dict[str, np.ndarray] = {}
    records = []
    for node in graph.topological_order():
        if node.type == "Placeholder":
            outputs = [given.get(f"{node.name}:0")]
        elif node.type == "Variable":
            outputs = [imported.weights.get(node.name)]
        elif node.type == "Const":
            outputs = [decode_value(node.attrs["value"])]
        else:
            outputs = [values.get(tensor_onnx.get(f"{node.name}:{k}"))
                       for k in range(len(node.outputs))]
        if node.type == "NoOp" or not outputs or any(v is None for v in outputs):
            continue
        outputs = [np.asarray(v) for v in outputs]
        have.update((f"{node.name}:{k}", v) for k, v in enumerate(outputs))
        records.append(Record(op_spec(graph, node), [have.get(t) for t in node.inputs],
                              outputs, None, stamp))
    writer.write_step(0, records)
    writer.finish()
    return writer.run_dir


def dump_model(imported: ImportedModel, root: str, feeds: Mapping[str, np.ndarray],
               precision_mode: str = ATC_DEFAULT_MODE, overflow_mode: str = "saturation",
               fusion_switch=None, modify_mixlist=None, reference: Optional[str] = None,
               progress=None) -> ModelRun:
    """Run the model once on the golden executor and on the simulated NPU, both dumped
    (step 0; the NPU with its overflow check) into the workspace at root. reference
    'onnxruntime' also writes ORT's node values as a cpu run marked values_from
    (write_reference_run). feeds:
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
        reference_run = write_reference_run(imported, root, feeds, ort_values, reference)
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
    device_dtypes = {name: _device_dtype(npu.compiled.graph, fetch)
                     for name, fetch in imported.outputs.items()}
    npu.close()
    outputs = {name: (g, n) for name, g, n in zip(imported.outputs, golden_out, npu_out)}
    return ModelRun(npu_run=hooks.dump_dirs(npu)[0], golden_run=hooks.dump_dirs(golden)[0],
                    reference_run=reference_run, outputs=outputs, float_status=status,
                    reference=diffs, device_dtypes=device_dtypes)


def _device_dtype(graph, fetch) -> str:
    """The dtype of a fetched tensor in the compiled graph ("" where the compiler renamed it)."""
    try:
        return str(graph.tensor(getattr(fetch, "name", fetch)).dtype)
    except GraphError:
        return ""
