"""The analysis layer: metrics, the NPU-to-golden mapping, vector compare and its verdicts,
overflow analysis, summaries, root cause within and across steps, replays (single op, fusion
off with pass bisection, what-if), and the auto check that ties them together. Its names load
with the module that defines them (PEP 562): a summary of a result needs neither the replays
nor the runtime."""
import importlib

_WHERE = {
    "autocheck": ("AutoCheck", "auto_check"),
    "compare": ("compare_step", "vector_compare"),
    "fusion_bisect": ("FusionVerdict", "bisect_fusion", "fired_passes", "replay_with_passes"),
    "impact": ("ImpactRanking", "rank_by_impact"),
    "loss_scale": ("LossScaleHistory", "loss_scale_history"),
    "mapping": ("TensorMap",),
    "metrics": ("METRICS", "compare_tensors"),
    "ops": ("Found", "OpRow", "export_subgraph", "find_op", "find_tensor", "list_ops",
            "subgraph_dot"),
    "overflow": ("OverflowReport", "OverflowTask", "overflow_report"),
    "op_replay": ("OpReplay", "ReplayOpError", "replay_op"),
    "result": ("Coverage", "Provenance", "StaleResultError", "coverage", "current_result",
               "read_provenance", "read_result", "staleness", "write_failure", "write_result"),
    "rootcause": ("Divergence", "RootCause", "root_cause"),
    "steps": ("StateTrace", "trace_state"),
    "summary": ("OpSummary", "count_findings", "summarize"),
    "verdicts": ("Criteria", "diverging", "judge", "verdict"),
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
