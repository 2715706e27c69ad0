"""A run of the workspace as its listing found it: its target, name, directory, run.json and
which steps and replay bundles are whole or partial."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from ..errors import WorkspaceError
from . import layout


@dataclass
class StepDump:
    step: int
    path: str
    complete: bool          # its index.csv is written (an interrupted step has none)


@dataclass
class Run:
    target: str
    name: str
    path: str
    info: dict
    steps: List[StepDump] = field(default_factory=list)
    # steps left partial (a dump killed, or stopped by a write failure): their dump
    # directory or their replay bundle (never read); partials: those directories
    interrupted: List[int] = field(default_factory=list)
    partials: List[str] = field(default_factory=list)
    bundles: List[int] = field(default_factory=list)      # steps with a whole replay bundle

    @property
    def kind(self) -> str:
        """layout.DEVICE (the run under test) or layout.REFERENCE (layout.target_of)."""
        return layout.target_of(self.target, self.info).kind

    @property
    def config(self):
        """The run's configuration as run.json records it, typed (runtime.SessionConfig): a
        device run's precision mode, amp level, overflow mode and graph mode, the golden's dtype;
        the defaults where a foreign run records none. A hand-edited value the policy does
        not know is an error naming the run."""
        from ..runtime.config import ConfigError, SessionConfig
        keys = ("precision_mode", "amp_level", "overflow_mode", "mode") \
            if self.kind == layout.DEVICE else ("golden_dtype",)
        given = {k: self.info[k] for k in keys if self.info.get(k) is not None}
        try:
            return SessionConfig(**given)
        except (ConfigError, TypeError) as e:
            raise WorkspaceError(f"{self.label}: run.json holds a configuration that cannot be "
                                 f"used: {e}") from None

    @property
    def why_partial(self) -> str:
        """Why its partial steps are partial, as far as the run knows: the write failure
        that stopped its dump (run.json's dump_stopped), else a dump killed mid-step."""
        if self.info.get("source"):
            return (f"their {self.info.get('format', 'foreign')} dump has no dump.json: it "
                    f"is written as a step ends, so the step was cut off")
        stopped = self.info.get("dump_stopped")
        if isinstance(stopped, dict):
            return f"the dump stopped at step {stopped.get('step')}: {stopped.get('error')}"
        return "the dump was killed or failed while writing them"

    @property
    def ended_early(self) -> str:
        """How the script that made the run ended before its end ("" when it did not): its
        error and the step it was in (run.json's script_failed: the front-end's, or the
        runner's for a script a signal killed). That step is not dumped; the others are."""
        failed = self.info.get("script_failed")
        if not isinstance(failed, dict):
            return ""
        step = failed.get("step")
        # a step before it may have been cut off while it was being written (its writer
        # thread's, when a signal killed the script)
        cut = [s for s in self.interrupted if isinstance(step, int) and s < step]
        before = "the steps before it are" if not cut else \
            f"the steps before it are but {layout.format_steps(cut)}, cut off while written"
        return f"the script ended in step {step} ({failed.get('error')}): that step is not " \
               f"dumped, {before}"

    @property
    def ours(self) -> bool:
        return self.info.get("writer") == "precision_tool"

    @property
    def calls_by_index(self) -> bool:
        """Its calls are named by API and call index and each input has a file of its own
        (an msprobe dump): a compare pairs calls in place and inputs by position."""
        return self.info.get("format") == "msprobe"

    @property
    def label(self) -> str:
        """How commands name the run: npu/debug_0."""
        return f"{self.target}/{self.name}"

    @property
    def complete_steps(self) -> List[int]:
        return [s.step for s in self.steps if s.complete]

    def step(self, number: int) -> StepDump:
        for s in self.steps:
            if s.step == number and s.complete:
                return s
        if number in self.interrupted or any(s.step == number for s in self.steps):
            raise WorkspaceError(f"step {number} of {self.label} is partial ({self.why_partial}); "
                                 f"it is not read (dumped steps: "
                                 f"{layout.format_steps(self.complete_steps) or 'none'})")
        raise WorkspaceError(f"{self.label} has no dump of step {number}; "
                             f"dumped steps: {layout.format_steps(self.complete_steps) or 'none'}")
