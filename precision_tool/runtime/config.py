"""Session configuration."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Optional

from ..errors import PrecisionToolError
# the modes a config accepts; what each means is the policy's (npu.policy owns the rules)
from .npu.policy import AMP_LEVELS, PRECISION_MODES, mode_of

GOLDEN_DTYPES = ("float32", "float64")
OVERFLOW_MODES = ("saturation", "inf_nan")
MODES = ("graph", "pynative")


class ConfigError(PrecisionToolError, ValueError):
    """A SessionConfig that cannot be used as given."""


@dataclass(frozen=True)
class SessionConfig:
    """How a Session runs its graph.

    CPU golden executor:
      golden_dtype: "float32", or "float64" for a reference run; every float tensor runs as it.
    Simulated NPU (target="npu"):
      precision_mode: force_fp32, allow_fp32_to_fp16 (default), force_fp16,
        must_keep_origin_dtype, allow_mix_precision, allow_mix_precision_bf16.
      amp_level: MindSpore's O0-O3, instead of precision_mode.
      modify_mixlist: a dict or JSON path editing the white/black/gray lists.
      overflow_mode: "saturation" (Ascend 910's default) or "inf_nan".
      fusion_switch_file: a fusion_switch.cfg path; or fusion_switch: "on", "off" or its dict.
      mode: "graph" (compile: fusion, 5HD formats) or "pynative" (op by op as written).
      device_memory: bytes of simulated device memory (default 32 GiB).
    Both:
      observers: factories whose attach(session) returns a run observer (see Session); the
        dump hooks put theirs here, so that a config alone turns dumping on.
    """
    golden_dtype: str = "float32"
    precision_mode: str = "allow_fp32_to_fp16"
    amp_level: Optional[str] = None
    modify_mixlist: Any = None
    overflow_mode: str = "saturation"
    fusion_switch_file: Optional[str] = None
    fusion_switch: Any = None
    mode: str = "graph"
    device_memory: int = 32 * 2 ** 30
    observers: tuple = ()

    def __post_init__(self):
        if self.precision_mode not in PRECISION_MODES:
            raise ConfigError(f"precision_mode must be one of {', '.join(PRECISION_MODES)}, "
                              f"got {self.precision_mode!r}")
        if self.amp_level is not None and self.amp_level not in AMP_LEVELS:
            raise ConfigError(f"amp_level must be one of {', '.join(AMP_LEVELS)} (or None), "
                              f"got {self.amp_level!r}")
        if self.golden_dtype not in GOLDEN_DTYPES:
            raise ConfigError(f"golden_dtype must be one of {GOLDEN_DTYPES}, got {self.golden_dtype!r}")
        if self.overflow_mode not in OVERFLOW_MODES:
            raise ConfigError(f"overflow_mode must be one of {OVERFLOW_MODES}, got {self.overflow_mode!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.fusion_switch_file is not None and self.fusion_switch is not None:
            raise ConfigError("give fusion_switch_file or fusion_switch, not both")
        if self.mode == "pynative" and (self.fusion_switch_file is not None
                                        or not _switches_nothing_on(self.fusion_switch)):
            raise ConfigError("fusion switches only mean something in graph mode (pynative runs "
                              "op by op, never fused): drop the switch or use mode='graph'")
        if not isinstance(self.device_memory, int) or self.device_memory <= 0:
            raise ConfigError(f"device_memory must be a positive number of bytes, "
                              f"got {self.device_memory!r}")

    def to_dict(self, fusion_ran=None) -> dict:
        """The config as saved files hold it (replay.json, run.json, a repair's fix.json):
        plain JSON, the mixlist inlined, and the fusion switch inlined as the passes that ran
        (`fusion_ran`: their names, as a compiled graph records them) or as given. No
        observers: they are the process's, not the config's."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("observers", "fusion_switch_file", "fusion_switch", "modify_mixlist")}
        if fusion_ran is not None:
            from .npu.fusion import switch_for
            out["fusion_switch"] = switch_for(set(fusion_ran))
        else:
            spec = self.fusion_switch_spec
            if isinstance(spec, (str, os.PathLike)) and spec not in ("on", "off"):
                from ..fileio import load_json
                spec = load_json(spec, ConfigError, "fusion switch file")
            out["fusion_switch"] = spec
        if self.modify_mixlist is None:
            out["modify_mixlist"] = None
        else:
            from .npu.policy import load_mixlist
            out["modify_mixlist"] = load_mixlist(self.modify_mixlist)
        return out

    @classmethod
    def from_dict(cls, data: dict, **overrides) -> "SessionConfig":
        """A config from to_dict's form (unknown keys refused in one line)."""
        values = dict(data)
        values.update(overrides)
        unknown = sorted(set(values) - {f.name for f in fields(cls)} - {"observers"})
        if unknown:
            raise ConfigError(f"unknown session config field(s) {unknown}")
        return cls(**values)

    @property
    def effective_mode(self) -> str:
        """The mode the NPU's policy applies: the amp level when there is one, else the
        precision mode."""
        return mode_of({"amp_level": self.amp_level, "precision_mode": self.precision_mode})

    def check_policy(self) -> dict:
        """The mixlist as the policy reads it (a file read now), checked against the mode
        (an NPU compile would refuse it the same way): a command that is about to work for a
        while fails first. Returns the loaded mixlist, or None."""
        from .npu.policy import load_mixlist, make_policy
        mixlist = load_mixlist(self.modify_mixlist) if self.modify_mixlist is not None else None
        make_policy(self.precision_mode, self.amp_level, mixlist)
        return mixlist

    @property
    def fusion_switch_spec(self):
        return self.fusion_switch_file if self.fusion_switch_file is not None else self.fusion_switch


def _switches_nothing_on(switch) -> bool:
    """A fusion switch that turns no pass on: none, "off", or a dict with every pass off (what
    a pynative run's replay bundle records: the passes that ran, none)."""
    if switch is None or switch == "off":
        return True
    if not isinstance(switch, dict):
        return False
    from .npu.fusion import enabled_passes
    try:
        return not enabled_passes(switch)
    except PrecisionToolError:
        return False
