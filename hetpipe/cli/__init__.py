"""The ``hetpipe`` command line: one module per command family, terminal tables, timelines, the demo."""

from hetpipe.cli.app import main

__all__ = ["main"]
