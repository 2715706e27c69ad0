"""What `fix` wrote for a PyTorch script (config/fix.json), read back by torch-run --fix and
the debugger: the precision mode, the calls kept in fp32 and the fusion passes off. A graph run's fix.json (op
types, fusion switches) is refused with the reason. Needs no torch."""
from __future__ import annotations

from ..errors import PrecisionToolError
from ..fileio import load_json
from ..runtime.config import PRECISION_MODES
from ..runtime.npu.fusion import PASSES


class FixFileError(PrecisionToolError, ValueError):
    """A fix file that cannot be applied."""


def read_fix(path: str) -> dict:
    """{"precision_mode": ..., "keep_fp32": [...], "fusion_off": [...]} from a fix.json (the
    config it holds)."""
    data = load_json(path, FixFileError, "fix file")
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        raise FixFileError(f"fix file {path} holds no fix (no \"config\" object): is it "
                           f"what precision-tool fix wrote?")
    mode = config.get("precision_mode")
    if mode is not None and mode not in PRECISION_MODES:
        raise FixFileError(f"fix file {path}: precision_mode {mode!r} is not one of "
                           f"{', '.join(PRECISION_MODES)}")
    keep = config.get("keep_fp32", [])
    if not isinstance(keep, list) or not all(isinstance(k, str) and k.strip() for k in keep):
        raise FixFileError(f"fix file {path}: keep_fp32 must be a list of API names or "
                           f"module paths")
    if data.get("front_end") != "pytorch":
        raise FixFileError(f"fix file {path} is a graph run's fix (op types, fusion "
                           f"switches): train that graph with it; a PyTorch script takes "
                           f"the fix that `fix` writes for its own run")
    off = config.get("fusion_off", [])
    if not isinstance(off, list) or not all(isinstance(p, str) and p in PASSES for p in off):
        raise FixFileError(f"fix file {path}: fusion_off must be a list of fusion passes "
                           f"({', '.join(PASSES)})")
    out = {"keep_fp32": list(keep), "fusion_off": list(off)}
    if mode is not None:
        out["precision_mode"] = mode
    return out
