"""Schedules as action lists: actions, builders, validator, simulator (torch-free)."""
