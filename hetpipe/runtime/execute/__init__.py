"""Execution: the per-rank action executor, point-to-point communication, held-memory accounting, step statistics."""
