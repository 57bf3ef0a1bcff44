"""Emulation: a CPU rank behaves like its plan device (speed, memory limit, links)."""
