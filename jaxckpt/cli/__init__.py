"""The ``jaxckpt`` command; each subcommand's module is imported only when that subcommand runs."""
from jaxckpt.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
