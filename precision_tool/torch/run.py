"""`python -m precision_tool.torch.run SCRIPT ARGS...`: a PyTorch training script run unchanged
with the debugger attached (what `precision-tool torch-run` starts): its settings come from
the environment the command sets, a step ends with each optimizer step, and the script's own
exit code and traceback pass through. The script runs as __main__ with sys.argv as given; the
random generators are seeded first (PRECISION_TOOL_TORCH_SEED, default 0), so that a golden
and an NPU run of one script draw the same numbers."""
from __future__ import annotations

import os
import runpy
import sys

ENV = {"target": "PRECISION_TOOL_TORCH_TARGET", "precision_mode": "PRECISION_TOOL_TORCH_MODE",
       "overflow_mode": "PRECISION_TOOL_TORCH_OVERFLOW", "dump_step": "PRECISION_TOOL_DUMP_STEP",
       "dump_mode": "PRECISION_TOOL_TORCH_DUMP_MODE", "data_dir": "PRECISION_TOOL_DATA",
       "keep_fp32": "PRECISION_TOOL_TORCH_KEEP_FP32",
       "golden_dtype": "PRECISION_TOOL_TORCH_GOLDEN_DTYPE",
       "fusion_switch": "PRECISION_TOOL_TORCH_FUSION",
       "replay_of": "PRECISION_TOOL_TORCH_REPLAY_OF",
       "skip_steps": "PRECISION_TOOL_TORCH_SKIP_STEPS",
       "state_from": "PRECISION_TOOL_TORCH_STATE_FROM"}
ENV_SEED = "PRECISION_TOOL_TORCH_SEED"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.stderr.write("usage: python -m precision_tool.torch.run SCRIPT [ARGS...]\n")
        return 2
    import random

    import numpy as np
    import torch

    from .debugger import PrecisionDebugger
    from .state import StateReplayed
    settings = {k: os.environ[v] for k, v in ENV.items() if os.environ.get(v)}
    debugger = PrecisionDebugger(**settings)
    debugger.auto_steps = True
    seed = int(os.environ.get(ENV_SEED, "0"))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    from torch.optim.optimizer import register_optimizer_step_post_hook
    # a step ends with the optimizer's, or with GradScaler's update where one scales the
    # loss (it skips the optimizer's step when the gradients are not finite)
    handle = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: None if debugger.scaling else debugger.step())
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    debugger.start()
    # what reruns the script the same way (fix does)
    debugger.note(script=[os.path.abspath(argv[0]), *argv[1:]], cwd=os.getcwd(), seed=seed)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except StateReplayed:           # the step started from the NPU's state is written
        debugger.stop()
    except SystemExit as e:
        debugger.stop(None if e.code in (None, 0) else e)
        raise
    except BaseException as e:
        debugger.stop(e)
        raise
    else:
        debugger.stop()
    finally:
        handle.remove()
        if debugger.run_dir:
            sys.stderr.write(f"precision_tool: {debugger.target} run {debugger.run_dir}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
