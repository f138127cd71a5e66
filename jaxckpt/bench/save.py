"""``jaxckpt bench save`` (placeholder until the benchmark lands)."""
import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(run=lambda args: 0)
