"""`specpipe` command line: each subcommand lives beside the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from pipeline.errors import USER_ERROR_EXIT_CODE, UserError

# Modules exposing `register(subparsers)`; each sets `func(args) -> int | None` on its parsers. The command
# names let the others run where one module's dependency is missing (a GPU image without tritonclient).
COMMAND_MODULES = {
    "pipeline.convert.cli": ("convert",),
    "pipeline.builder.cli": ("build",),
    "pipeline.engine.cli": ("generate", "eval-acceptance"),
    "pipeline.triton.cli": ("triton-repo", "serve"),
    "pipeline.client.cli": ("client", "verify"),
    "pipeline.bench.cli": ("bench", "compare"),
    "pipeline.train.cli": ("train",),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, commands in COMMAND_MODULES.items():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            package = (exc.name or "pipeline").split(".")[0]
            if package == "pipeline":
                raise
            for command in commands:
                sub.add_parser(command, help=f"(needs {package})").set_defaults(func=_missing(package))
            continue
        module.register(sub)
    return parser


def _missing(package: str) -> Callable[[argparse.Namespace], int]:
    def fail(args: argparse.Namespace) -> int:
        raise UserError(f"needs the Python package {package}, which is not installed; run `make setup`")

    return fail


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"specpipe {args.command}: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
