"""One-line dump hooks for training scripts, as Ascend's precision_tool offers them.

    cfg = hooks.session_dump_config(pt.SessionConfig(...), action="dump|fusion_off")
    sess = pt.Session(graph, target="npu", config=cfg)          # the NPU run is dumped
    golden = hooks.sess_dump(pt.Session(graph, target="cpu"))    # the golden run is dumped

Without `action` the hooks read it from the environment, where the script runner puts it
(`precision-tool npu-dump|npu-overflow|cpu-dump -- python train.py`): so the same unchanged
script writes nothing when run plainly, and dumps under the runner.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from . import layout
from .dumper import DumpHook, DumpObserver
from ..runtime import SessionConfig


def _settings(action, dump_step, dump_mode, dump_data, data_dir, debug_dir, env_action,
              replay_of=None, values_from=None, first_free=0, on_write_error=None):
    actions = layout.parse_action(action if action is not None else os.environ.get(env_action))
    if dump_step is None:
        dump_step = os.environ.get(layout.ENV_DUMP_STEP)
    if dump_step is None:           # the whole run for overflow checks, step 0 for dumps
        dump_step = "all" if "dump" not in actions else "0"
    return actions, layout.DumpSettings(
        root=layout.resolve_root(data_dir), actions=actions,
        steps=layout.parse_steps(dump_step),
        mode=dump_mode or os.environ.get(layout.ENV_DUMP_MODE) or "all",
        data=dump_data or os.environ.get(layout.ENV_DUMP_DATA) or "tensor",
        debug_dir=debug_dir, replay_of=replay_of, values_from=values_from,
        first_free=first_free,
        on_write_error=on_write_error or os.environ.get(layout.ENV_ON_WRITE_ERROR) or "stop")


def session_dump_config(config: Optional[SessionConfig] = None, action: Optional[str] = None,
                        dump_step: Optional[str] = None, dump_mode: Optional[str] = None,
                        dump_data: Optional[str] = None, data_dir: Optional[str] = None,
                        debug_dir: Optional[str] = None,
                        fusion_switch_file: Optional[str] = None,
                        replay_of: Optional[str] = None, first_free: int = 0,
                        on_write_error: Optional[str] = None) -> SessionConfig:
    """The NPU session config with the actions turned on: any '|'-joined combination of
    dump, overflow, fusion_off and fusion_switch (the switch file given, or
    <workspace>/config/fusion_switch.cfg). dump_step: "0|5|10" or "0|3-5|10" (default "0",
    or every step for a plain overflow check); dump_mode: input, output or all; dump_data:
    tensor or stats (index rows only). replay_of names the run a replay reruns (analysis
    commands then default to the original, not the replay); first_free: the least k of the
    debug_<k> it makes (a replay beside a read-only workspace: Workspace.first_free).
    on_write_error: "stop" (default) — a dump that cannot write (a full disk) stops dumping
    with one warning and the training goes on; "raise" — the training step raises the
    DumpWriteError."""
    config = config or SessionConfig()
    actions, settings = _settings(action, dump_step, dump_mode, dump_data, data_dir, debug_dir,
                                  layout.ENV_NPU_ACTION, replay_of, first_free=first_free,
                                  on_write_error=on_write_error)
    changes = {}
    if "fusion_off" in actions:
        changes.update(fusion_switch="off", fusion_switch_file=None)
    if "fusion_switch" in actions:
        path = fusion_switch_file or os.path.join(settings.root, "config", "fusion_switch.cfg")
        changes.update(fusion_switch=None, fusion_switch_file=path)
    if actions & {"dump", "overflow"}:
        changes["observers"] = tuple(config.observers) + (DumpHook(settings),)
    return dataclasses.replace(config, **changes) if changes else config


def attach_dump(session, action: Optional[str] = None, dump_step: Optional[str] = None,
                dump_mode: Optional[str] = None, dump_data: Optional[str] = None,
                data_dir: Optional[str] = None, debug_dir: Optional[str] = None,
                values_from: Optional[str] = None, on_write_error: Optional[str] = None):
    """Dump an existing session's runs from its next run on, NPU or golden, into
    <workspace>/<target>/debug_<k>: the dump and overflow actions (an overflow check only means
    something on the NPU). Returns the observer (close() waits until its steps are on disk),
    or None when no action applies. The fusion actions change how the graph compiles, so they
    go into the session's config (session_dump_config), not here. values_from names where the
    values the session's runs are handed come from (Session.run's substitute), when not from
    its own kernels: run.json says so, and commands never take such a run by default.
    on_write_error: see session_dump_config."""
    npu = session.target == "npu"
    actions, settings = _settings(action, dump_step, dump_mode, dump_data, data_dir, debug_dir,
                                  layout.ENV_NPU_ACTION if npu else layout.ENV_CPU_ACTION,
                                  values_from=values_from, on_write_error=on_write_error)
    fusion = sorted(actions & {"fusion_off", "fusion_switch"})
    if fusion and npu:
        raise layout.DumpConfigError(
            f"{'|'.join(fusion)} changes how the graph compiles, so it cannot be switched on in a "
            f"running session: give it to hooks.session_dump_config() for the session's config")
    if not (actions & ({"dump", "overflow"} if npu else {"dump"})):
        return None
    observer = DumpObserver(session, settings)
    session.add_observer(observer)
    return observer


def dump_dirs(session) -> list:
    """The run directories (<workspace>/<target>/debug_<k>) this session's dumps write: what
    it made itself, whatever other processes write into the same workspace meanwhile."""
    return [o.run_dir for o in session.observers
            if isinstance(o, DumpObserver) and o.run_dir is not None]


def sess_dump(session, action: Optional[str] = None, dump_step: Optional[str] = None,
              dump_mode: Optional[str] = None, dump_data: Optional[str] = None,
              data_dir: Optional[str] = None, debug_dir: Optional[str] = None,
              on_write_error: Optional[str] = None):
    """Dump this (CPU golden) session's runs into <workspace>/cpu/debug_<k>. Returns the
    session. With no action given or in the environment, it changes nothing.
    on_write_error: see session_dump_config."""
    if session.target != "cpu":
        raise layout.DumpConfigError("sess_dump is for the golden (cpu) session; the NPU session "
                                     "takes hooks.session_dump_config() in its config")
    attach_dump(session, action, dump_step, dump_mode, dump_data, data_dir, debug_dir,
                on_write_error=on_write_error)
    return session


def watch(config: Optional[SessionConfig] = None, data_dir: Optional[str] = None,
          conditions=None, **thresholds) -> SessionConfig:
    """The session config with training watchpoints on (dump.watch): every step's statistics
    tested against the conditions (all, or those named), hits appended to
    <workspace>/watch/hits.csv and the first of each said on stderr. thresholds: WatchConfig's
    fields (grad_min, grad_max, update_min, update_max, loss_patience, scale_patience)."""
    from .watch import WatchHook
    config = config or SessionConfig()
    hook = WatchHook(_watch_config(conditions, thresholds), layout.resolve_root(data_dir))
    return dataclasses.replace(config, observers=tuple(config.observers) + (hook,))


def attach_watch(session, data_dir: Optional[str] = None, conditions=None, **thresholds):
    """Watch an existing session's runs from its next run on (see watch); returns the
    observer (its `hits` list)."""
    from .watch import WatchObserver
    observer = WatchObserver(session, _watch_config(conditions, thresholds),
                             layout.resolve_root(data_dir))
    session.add_observer(observer)
    return observer


def _watch_config(conditions, thresholds):
    from .watch import CONDITIONS, WatchConfig
    names = frozenset(conditions) if conditions is not None else None
    unknown = sorted((names or set()) - set(CONDITIONS))
    if unknown:
        raise layout.DumpConfigError(f"unknown watch condition(s) {unknown}; known: "
                                     f"{', '.join(CONDITIONS)}")
    fields = set(WatchConfig.__dataclass_fields__) - {"conditions"}
    wrong = sorted(set(thresholds) - fields)
    if wrong:
        raise layout.DumpConfigError(f"unknown watch threshold(s) {wrong}; known: {', '.join(sorted(fields))}")
    return WatchConfig(conditions=names, **thresholds)
