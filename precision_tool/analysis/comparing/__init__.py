"""Compare and verdicts: the metrics, the NPU-to-golden mapping, the vector compare and its engine, the verdicts, the results on disk and their summaries."""
