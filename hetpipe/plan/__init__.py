"""The plan: its types and file format (all versions), check, building a plan from a solution, replica assembly, analysis."""
