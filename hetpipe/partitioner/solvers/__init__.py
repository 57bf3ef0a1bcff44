"""Solvers of the partition problem: exact DP, fixed-order heuristic, node-free relaxation, CP-SAT."""
