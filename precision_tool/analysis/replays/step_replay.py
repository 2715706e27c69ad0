"""A dumped step replayed from its replay bundle under changed configurations (a fusion pass
off, an op type in fp32, a loss scale, a precision mode), judged against the golden replay of
the same bundle: what `fix` searches with and what `ac` verifies its advice with.

What is judged is what the step produces: the fetched outputs and every variable's update
(new value less old), through `verdicts.judge`, so the thresholds are vc's; an update in its
variable's declared dtype. Outputs and updates on which the golden's float32 and float64
replays disagree (rounding noise: an exact-zero gradient that Adam turns into steps) are
left out of the goal.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from ...graph import dtypes
from ...ops import registry
from ...runtime import Session, SessionConfig
from ...runtime.npu.fusion import PASSES, enabled_passes, switch_for
from ...runtime.npu.policy import mixlist_mode
from ...train.loss_scale import loss_scale_variable
from ..comparing.metrics import compare_tensors
from .remedy import NO_HELP, VERIFIED, Change
from ..comparing.verdicts import DIVERGING, Criteria, judge

LOW = ("float16", "bfloat16")


@dataclass
class Outcome:
    """One replay of the step under a set of changes, against the golden replay."""
    passed: bool
    overflow: bool                   # the step's status word was not zero
    loss_error: float                # relative error of the fetched loss (nan: no loss)
    failing: List[str]               # outputs and updates that diverge, with what decided


# -- configurations ---------------------------------------------------------------------------
def configure(base: dict, changes: Sequence[Change]) -> dict:
    """SessionConfig fields for the bundle's configuration `base` with the changes applied."""
    cfg = dict(base)
    kinds = {c.kind: c for c in changes}
    fp32 = sorted(c.name for c in changes if c.kind == "fp32")
    if "mode" in kinds:
        _set_mode(cfg, kinds["mode"].name)
        cfg["modify_mixlist"] = None
    elif fp32:
        _set_mode(cfg, mixlist_mode(SessionConfig.from_dict(cfg).effective_mode))
        mixlist = json.loads(json.dumps(cfg.get("modify_mixlist") or {}))
        black = mixlist.setdefault("black-list", {})
        black["to-add"] = sorted(set(black.get("to-add", [])) | set(fp32))
        black["to-remove"] = [t for t in black.get("to-remove", []) if t not in fp32]
        if not black["to-remove"]:
            del black["to-remove"]
        cfg["modify_mixlist"] = mixlist
    off = {c.name for c in changes if c.kind == "fusion"}
    if off:
        switch = switch_for(set(enabled_passes(cfg.get("fusion_switch"))) - off)
        for name in off:              # said, not only left out: the file a user reads
            switch["Switch"][PASSES[name].kind][name] = "off"
        cfg["fusion_switch"] = switch
    return cfg


def _set_mode(cfg: dict, mode: str) -> None:
    """A precision mode, or an amp level (O0-O3), in place of the config's."""
    amp = mode.startswith("O")
    cfg.update(amp_level=mode if amp else None,
               precision_mode=cfg.get("precision_mode") if amp else mode)


def _key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True, default=str)


# -- the step as a test -----------------------------------------------------------------------
class StepReplay:
    """The dumped step, replayed from its bundle under changed configurations and judged
    against the golden replay of the same bundle (computed once)."""

    def __init__(self, bundle, golden_dtype: str, criteria: Criteria,
                 loss_rtol: Optional[float] = None):
        self.bundle = bundle
        self.base = dict(bundle.meta["config"])
        self.criteria = criteria
        self.loss_rtol = loss_rtol
        self.golden_config = SessionConfig(golden_dtype=golden_dtype)
        self.scale_variable = loss_scale_variable(bundle.graph)
        self.updates_state = any(registry.updated_inputs(n.type) for n in bundle.graph.nodes)
        self._declared = {n.name: dtypes.to_numpy(n.outputs[0].dtype)
                          for n in bundle.graph.nodes if n.type == "Variable" and n.outputs}
        self._sessions: Dict[str, Session] = {}
        self.replays = 0
        self.golden = self._step(bundle.session("cpu", self.golden_config), {})
        # what the reference itself cannot pin down: the outputs and updates on which its
        # float32 and float64 replays disagree hold rounding noise (an exact-zero gradient
        # that Adam turns into steps), and the goal leaves them out
        other = "float64" if golden_dtype == "float32" else "float32"
        probe = self._step(bundle.session("cpu", SessionConfig(golden_dtype=other)), {})
        self.noise = set()
        self.noise = {name for name, _ in self._diverging(probe, ())}

    def session(self, cfg: dict) -> Session:
        key = _key(cfg)
        if key not in self._sessions:
            self._sessions[key] = self.bundle.session("npu", SessionConfig.from_dict(cfg))
        return self._sessions[key]

    def _variables(self, changes: Sequence[Change]) -> Dict[str, np.ndarray]:
        values = dict(self.bundle.variables)
        for c in changes:
            if c.kind == "loss_scale" and self.scale_variable:
                old = values[self.scale_variable]
                values[self.scale_variable] = np.asarray(c.value, dtype=old.dtype)
        return values

    def _step(self, sess: Session, variables: Dict[str, np.ndarray]):
        self.bundle.start(sess, variables or None)
        before = sess.variables()
        fetched = self.bundle.run_step(sess)
        return fetched, before, sess.variables(), sess.float_status()

    def run(self, changes: Sequence[Change]) -> Outcome:
        """The step under these changes, judged."""
        self.replays += 1
        sess = self.session(configure(self.base, changes))
        return self.judge(self._step(sess, self._variables(changes)), changes)

    def _diverging(self, npu, changes: Sequence[Change]) -> List[Tuple[str, str]]:
        """(name, what decided) of each fetched float output and variable update that
        diverges from the golden replay's (variables named as they are, outputs by tensor)."""
        values, before, after, _ = npu
        g_values, g_before, g_after, _ = self.golden
        rows, names = [], []
        for name, v in values.items():
            v = np.asarray(v)
            if name not in self.noise and is_float(v.dtype):
                rows.append(_row(v, g_values[name], str(v.dtype)))
                names.append(name)
        skip = set(self.noise)
        if any(c.kind == "loss_scale" for c in changes):
            skip.add(self.scale_variable)
        for name in sorted(after):
            if name in skip or not is_float(after[name].dtype):
                continue
            # dtype-aware: an update computes in its variable's declared dtype, so a variable
            # declared fp16 can take the golden's new value only rounded to fp16 (the golden
            # holds every tensor in its own dtype)
            declared = self._declared.get(name, after[name].dtype)
            rows.append(_row(after[name].astype(np.float64) - before[name],
                             _rounded(g_after[name], declared) - g_before[name], str(declared)))
            names.append(name)
        if not rows:
            return []
        judged = judge(pd.DataFrame(rows), self.criteria)
        return [(n, r or v) for n, v, r in zip(names, judged["Verdict"], judged["Reason"])
                if v in DIVERGING]

    def judge(self, npu, changes: Sequence[Change] = ()) -> Outcome:
        values, _, _, status = npu
        failing = [f"{'' if n in values else 'update of '}{n}: {why}"
                   for n, why in self._diverging(npu, changes)]
        loss_error = _loss_error(values, self.golden[0])
        if self.loss_rtol is not None:
            ok = status == 0 and loss_error <= self.loss_rtol
        else:
            ok = status == 0 and not failing
        return Outcome(bool(ok), status != 0, loss_error, failing)


def is_float(dtype: np.dtype) -> bool:
    return dtypes.category(dtype) == "float"


def _rounded(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The values as a tensor of `dtype` holds them, in float64."""
    return np.asarray(values).astype(dtype).astype(np.float64)


def _row(npu: np.ndarray, golden: np.ndarray, dtype: str) -> dict:
    row = compare_tensors(np.asarray(npu), np.asarray(golden))
    row.update(Elements=int(np.asarray(golden).size), NpuDataType=dtype,
               GoldenAbsMax=float(np.nanmax(np.abs(golden))) if np.size(golden) else np.nan)
    return row


def first_scalar(fetched: dict) -> Optional[np.ndarray]:
    """The first fetched float scalar: the loss, as a training step fetches it first."""
    return next((np.asarray(v) for v in fetched.values()
                 if np.size(v) == 1 and is_float(np.asarray(v).dtype)), None)


def _loss_error(values: dict, golden: dict) -> float:
    """Relative error of the first fetched float scalar (the loss); inf when it is not
    finite, nan without one."""
    name = next((k for k, v in values.items()
                 if np.size(v) == 1 and is_float(np.asarray(v).dtype)), None)
    if name is None:
        return math.nan
    x, y = float(np.asarray(values[name]).reshape(-1)[0]), float(np.asarray(golden[name]).reshape(-1)[0])
    if not math.isfinite(x):
        return math.inf
    return abs(x - y) / abs(y) if y else (0.0 if x == 0 else math.inf)


def check_remedies(replay: StepReplay, remedies: Sequence[Tuple[Change, ...]]) -> List[dict]:
    """What a replay of the step (quiet_replay: the variables the dumped step's compare
    found noise or without effect left out, as fix leaves them out) says of each remedy (a
    set of changes): "verified" when the step then meets fix's goal (every output and
    update within the criteria, no overflow), "does not help" with what still fails. A loss
    scale on a graph without one is not replayed (left out of the list)."""
    out = []
    for changes in remedies:
        if any(c.kind == "loss_scale" for c in changes) and replay.scale_variable is None:
            continue
        o = replay.run(changes)
        out.append({"changes": "; ".join(c.describe() for c in changes),
                    "verdict": VERIFIED if o.passed else NO_HELP,
                    "evidence": what_fails(o)})
    return out


def quiet_replay(bundle, golden_dtype: str, criteria: Criteria, quiet: Sequence[str] = ()) -> StepReplay:
    """A StepReplay whose goal leaves out the variables in `quiet` as well as its own noise."""
    replay = StepReplay(bundle, golden_dtype, criteria)
    replay.noise.update(quiet)
    return replay


def what_fails(o: Outcome) -> str:
    """What a replay leaves wrong, as the end of "a replay of step N with it ..."."""
    if o.passed:
        return "matches the golden"
    if math.isinf(o.loss_error):
        return "leaves the loss non-finite"
    parts = []
    if o.overflow:
        parts.append("still overflows")
    if o.failing:
        parts.append(f"leaves {len(o.failing)} output(s) or update(s) diverging, the first "
                     f"{o.failing[0]}")
    return " and ".join(parts)
