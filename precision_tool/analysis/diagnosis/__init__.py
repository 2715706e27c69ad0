"""Diagnosis from what was dumped: root cause within a step and across steps, drift, lost updates, overflow and the loss-scale history."""
