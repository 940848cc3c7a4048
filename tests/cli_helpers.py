"""Driving one ``vcluster`` sub-command in-process, as the console script does."""

from __future__ import annotations

import argparse


def run_cli(add_parser, argv) -> int:
    """Parse ``argv`` with a ``vcluster`` parser holding the sub-commands that
    ``add_parser`` registers, and run the chosen one; its exit code."""
    parser = argparse.ArgumentParser(prog="vcluster")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)
