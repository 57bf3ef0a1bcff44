"""Capture: a model traced on meta becomes a costed unit graph (fx/export, units, measurement)."""
