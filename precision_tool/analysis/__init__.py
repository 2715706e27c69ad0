"""The analysis layer, in four rooms: `comparing` (metrics, the NPU-to-golden mapping, the
vector compare and its engine, verdicts, results on disk, summaries), `diagnosis` (root cause
within and across steps, drift, lost updates, overflow, the loss-scale history), `replays`
(everything that reruns a dumped step from its bundle: single-op replay, fusion bisection,
the impact ranking, the step replay behind remedies, repair, the pre-training checks) and,
here, the auto check that ties them together with its advice, and `ops` (what the commands
show of a run's ops). Its names load with the module that defines them (PEP 562): a summary
of a result needs neither the replays nor the runtime."""
import importlib

_WHERE = {
    "autocheck": ("AutoCheck", "auto_check"),
    "model_report": ("ModelReport", "OutputVerdict", "judge_outputs", "model_report"),
    "ops": ("Conversion", "Found", "NodeInfo", "OpRow", "RunEntry", "RunListing",
            "TensorSummary", "convert_layout", "export_subgraph", "find_op", "find_tensor",
            "list_ops", "node_info", "run_listing", "subgraph_dot", "tensor_summary"),
    "comparing.compare": ("compare_step", "vector_compare"),
    "comparing.mapping": ("TensorMap",),
    "comparing.metrics": ("METRICS", "compare_tensors"),
    "comparing.result": ("CompareReport", "Coverage", "Provenance", "StaleResultError",
                         "coverage", "current_result", "read_provenance", "read_result",
                         "staleness", "write_failure", "write_result"),
    "comparing.summary": ("OpSummary", "VectorSummary", "count_findings", "summarize",
                          "summarize_result"),
    "comparing.verdicts": ("Criteria", "diverging", "judge", "verdict"),
    "diagnosis.scale_history": ("LossScaleHistory", "loss_scale_history"),
    "diagnosis.overflow": ("OverflowReport", "OverflowTask", "overflow_report"),
    "diagnosis.rootcause": ("Divergence", "RootCause", "root_cause"),
    "diagnosis.steps": ("StateTrace", "trace_state"),
    "replays.fusion_bisect": ("FusionVerdict", "bisect_fusion", "fired_passes",
                              "replay_with_passes"),
    "replays.impact": ("ImpactRanking", "rank_by_impact"),
    "replays.op_replay": ("OpReplay", "ReplayOpError", "replay_op"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
