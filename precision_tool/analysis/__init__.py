"""The analysis layer: metrics, the NPU-to-golden mapping, vector compare and its verdicts,
overflow analysis, summaries, root cause within and across steps, replays (single op, fusion
off with pass bisection, what-if), and the auto check that ties them together."""
from .autocheck import AutoCheck, auto_check
from .compare import vector_compare
from .fusion import FusionVerdict, bisect_fusion, fired_passes, replay_with_passes
from .impact import ImpactRanking, rank_by_impact
from .loss_scale import LossScaleHistory, loss_scale_history
from .mapping import TensorMap
from .metrics import METRICS, compare_tensors
from .overflow import OverflowReport, OverflowTask, overflow_report
from .replay_op import OpReplay, ReplayOpError, replay_op
from .result import (Coverage, Provenance, StaleResultError, coverage, current_result,
                     read_provenance, read_result, staleness, write_result)
from .rootcause import Divergence, RootCause, root_cause
from .steps import StateTrace, trace_state
from .summary import OpSummary, count_findings, summarize
from .verdicts import Criteria, diverging, judge, verdict

__all__ = ["AutoCheck", "auto_check", "vector_compare", "FusionVerdict", "bisect_fusion",
           "fired_passes", "replay_with_passes", "ImpactRanking", "rank_by_impact",
           "LossScaleHistory", "loss_scale_history", "TensorMap", "METRICS", "compare_tensors",
           "OverflowReport", "OverflowTask", "overflow_report", "OpReplay", "ReplayOpError",
           "replay_op", "Coverage", "Provenance", "StaleResultError", "coverage",
           "current_result", "read_provenance", "read_result", "staleness", "write_result", "Divergence", "RootCause",
           "root_cause", "StateTrace", "trace_state", "OpSummary", "count_findings",
           "summarize", "Criteria", "diverging", "judge", "verdict"]
