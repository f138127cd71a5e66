"""What every ``jaxckpt bench NAME`` shares: its output options, its command line, its run and its entry point.

A benchmark module supplies ``options(args)`` (effective settings; ValueError for bad ones, refused before anything
is measured), a measure function and a renderer; this module does the rest the same way for all of them:
``--from-json`` renders without measuring, ``--json`` keeps the raw result, ``--update-md`` rewrites the
benchmark's own section of a markdown file and keeps the result it rendered in ``docs/bench/NAME.json`` beside
that file (``report.record_json``: what ``--from-json`` re-renders the section from), and the rendered markdown
goes to stdout.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
from typing import Any, Callable, Mapping, Sequence

from jaxckpt.tools.bench import report

log = logging.getLogger("jaxckpt.tools.bench")


def output_arguments(p: argparse.ArgumentParser, name: str, quick_help: str, timeout: float | None = None) -> None:
    """Add --quick, --timeout (when ``timeout`` is a default), --json, --update-md and --from-json."""
    p.add_argument("--quick", action="store_true", help=quick_help)
    if timeout is not None:
        p.add_argument("--timeout", type=float, default=timeout, help="limit for each launched process, in seconds")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--update-md", metavar="PATH", help=f"rewrite the bench:{name} section of this markdown file "
                                                       f"and keep its JSON in docs/bench/{name}.json beside it")
    p.add_argument("--from-json", metavar="PATH", help="measure nothing: render (and --update-md) this result file")


def command_line(name: str, args: argparse.Namespace, flags: Sequence[tuple[str, str]]) -> str:
    """The command line that repeats this run: ``flags`` are (flag, attribute) pairs, given ones only."""
    words = ["jaxckpt", "bench", name] + (["--quick"] if args.quick else [])
    for flag, key in (*flags, ("--json", "json"), ("--update-md", "update_md")):
        if getattr(args, key, None) is not None:
            words += [flag, str(getattr(args, key))]
    return shlex.join(words)


def run(args: argparse.Namespace, name: str, options: Callable[[argparse.Namespace], Any],
        measure: Callable[[argparse.Namespace, Any], dict[str, Any]],
        render: Callable[[Mapping[str, Any]], str]) -> int:
    """Measure (or read ``--from-json``), write the JSON, print the markdown and update the section; the exit code."""
    if args.from_json:
        result = report.read_json(args.from_json)
    else:
        try:
            opts = options(args)
        except ValueError as e:
            log.error("%s", e)
            return 2
        result = measure(args, opts)
        if args.json:
            report.write_json(args.json, result)
    md = render(result)
    if args.update_md:
        report.replace_section(args.update_md, name, md)
        report.record_json(report.record_dir(args.update_md), name, result)
    print(md)
    return 0


def main(module: str, doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
         run_args: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """``python -m MODULE``: parse the benchmark's options, set up logging, run it."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or module).splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("JAXCKPT_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_args(args)
