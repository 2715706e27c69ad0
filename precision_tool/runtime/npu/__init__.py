"""The simulated NPU: precision policies, the compile pipeline with its fusion passes, and
the executor with NPU numerics, overflow modes and task status words."""
