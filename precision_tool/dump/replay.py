"""Replay bundles: everything needed to rerun one dumped step without the training script.

    replay/<step>/graph.json      the original (uncompiled) graph
    replay/<step>/variables.npz   every variable's value at the start of the step
    replay/<step>/feeds.npz       the step's feeds, by placeholder
    replay/<step>/replay.json     session step (it seeds Dropout), fetches, target, config

Arrays are stored under positional keys (v0, v1, ...) with their names in replay.json, so
that no op name ever becomes a path inside the archive; they load with allow_pickle=False.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Dict, List, Optional

import numpy as np

from ..errors import PrecisionToolError
from ..graph import Graph, graph_to_json
from ..runtime import Session, SessionConfig
from .writer import _atomic, save_text

BUNDLE_VERSION = 1


class ReplayError(PrecisionToolError, ValueError):
    """A replay bundle that cannot be used (missing, malformed, from another version)."""


def _config_dict(session) -> dict:
    cfg = session.config
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)
           if f.name not in ("observers", "fusion_switch_file", "fusion_switch", "modify_mixlist")}
    if session.target == "npu":
        from ..runtime.npu.fusion import GRAPH, PASSES
        ran = set(session.compiled.fusion)
        out["fusion_switch"] = {"Switch": {
            kind: dict([("ALL", "off")] + [(p, "on") for p, d in PASSES.items()
                                           if d.kind == kind and p in ran])
            for kind in (GRAPH, "UBFusion")}}
        from ..runtime.npu.policy import _load_mixlist
        out["modify_mixlist"] = (None if cfg.modify_mixlist is None
                                 else _load_mixlist(cfg.modify_mixlist))
    return out


def _save_npz(path: str, arrays: Dict[str, np.ndarray]) -> List[str]:
    names = list(arrays)
    _atomic(path, lambda f: np.savez(f, **{f"v{k}": np.asarray(arrays[n]) for k, n in enumerate(names)}))
    return names


def write_bundle(path: str, session, feeds: Dict[str, np.ndarray], fetch_tensors, fetch_nodes):
    os.makedirs(path, exist_ok=True)
    save_text(os.path.join(path, "graph.json"), graph_to_json(session.graph) + "\n")
    variables = session.variables()
    declared = {name: session.graph.node(name).outputs[0].dtype for name in variables}
    var_names = _save_npz(os.path.join(path, "variables.npz"), variables)
    feed_names = _save_npz(os.path.join(path, "feeds.npz"), feeds)
    meta = {"version": BUNDLE_VERSION, "session_step": session.step, "target": session.target,
            "fetch_tensors": list(fetch_tensors), "fetch_nodes": list(fetch_nodes),
            "variables": var_names, "variable_dtypes": declared, "feeds": feed_names,
            "config": _config_dict(session)}
    save_text(os.path.join(path, "replay.json"), json.dumps(meta, indent=1) + "\n")


@dataclass
class Bundle:
    path: str
    graph: Graph
    variables: Dict[str, np.ndarray]
    feeds: Dict[str, np.ndarray]
    meta: dict

    def config(self, **overrides) -> SessionConfig:
        cfg = dict(self.meta["config"])
        cfg.update(overrides)
        return SessionConfig(**cfg)


def _load_npz(path: str, names: List[str]) -> Dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[f"v{k}"] for k, name in enumerate(names)}
    except (OSError, ValueError, KeyError) as e:
        raise ReplayError(f"replay bundle file {path} is unreadable: {e}") from None


def load_bundle(path: str) -> Bundle:
    from ..io import load_graph
    meta_path = os.path.join(path, "replay.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as e:
        raise ReplayError(f"no replay bundle at {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReplayError(f"replay bundle {meta_path} is malformed: {e}") from None
    if not isinstance(meta, dict) or meta.get("version") != BUNDLE_VERSION:
        raise ReplayError(f"replay bundle {path} has an unsupported version")
    graph = load_graph(os.path.join(path, "graph.json"))
    variables = _load_npz(os.path.join(path, "variables.npz"), meta["variables"])
    feeds = _load_npz(os.path.join(path, "feeds.npz"), meta["feeds"])
    return Bundle(path, graph, variables, feeds, meta)


def replay(bundle: Bundle, target: Optional[str] = None, config: Optional[SessionConfig] = None):
    """Rerun the bundle's step on `target` (default: the one it was dumped from). Returns the
    session (its `step` is the dumped step's) and the fetched results."""
    target = target or bundle.meta["target"]
    if config is None:
        config = bundle.config() if target == bundle.meta["target"] else SessionConfig()
    sess = Session(bundle.graph, target=target, config=config)
    same = target == bundle.meta["target"] and config.golden_dtype == bundle.meta["config"].get("golden_dtype")
    sess.load_variables(bundle.variables, exact=same)
    sess.step = bundle.meta["session_step"]
    fetches = bundle.meta["fetch_tensors"] + bundle.meta["fetch_nodes"]
    return sess, sess.run(fetches, dict(bundle.feeds))
