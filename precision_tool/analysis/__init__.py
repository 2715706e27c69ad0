"""The analysis layer (in progress): metrics, the NPU-to-golden mapping and vector compare;
overflow analysis, summaries, root cause and replays build on them."""
from .autocheck import AutoCheck, auto_check
from .compare import vector_compare, verdict, write_result
from .loss_scale import LossScaleHistory, loss_scale_history
from .fusion import FusionVerdict, bisect_fusion, fired_passes, replay_with_passes
from .mapping import TensorMap
from .metrics import METRICS, compare_tensors
from .overflow import OverflowReport, OverflowTask, overflow_report
from .replay_op import OpReplay, ReplayOpError, replay_op
from .rootcause import Divergence, RootCause, root_cause
from .summary import OpSummary, count_findings, summarize

__all__ = ["AutoCheck", "auto_check", "LossScaleHistory", "loss_scale_history", "METRICS", "compare_tensors", "TensorMap", "vector_compare", "verdict", "write_result",
           "OverflowReport", "OverflowTask", "overflow_report",
           "OpSummary", "count_findings", "summarize", "Divergence", "RootCause", "root_cause",
           "OpReplay", "ReplayOpError", "replay_op",
           "FusionVerdict", "bisect_fusion", "fired_passes", "replay_with_passes"]
