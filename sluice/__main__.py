"""The `sluice` command line: `sluice serve [options]` (also `python -m sluice serve`)."""

from __future__ import annotations

import argparse
import sys

from sluice import __version__
from sluice.config import args_from_namespace, build_parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="sluice: an LLM serving engine with an OpenAI-compatible API."
    )
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = build_parser("sluice serve")
    commands.add_parser(
        "serve",
        parents=[serve],
        add_help=False,  # the parent parser brings -h
        help="serve a model over HTTP (see `sluice serve --help`)",
        description=serve.description,
        epilog=serve.epilog,
        formatter_class=serve.formatter_class,
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        from sluice.launch import launch_server

        try:
            args = args_from_namespace(ns)
        except ValueError as e:  # a value out of range: usage and the message, exit status 2
            parser.error(str(e))
        sys.exit(launch_server(args))


if __name__ == "__main__":
    main()
