"""The ``hicache`` command line: ``backends``, ``check`` and ``bench``.

Each verb lives in its own module (``cli/<verb>.py``) exposing ``add_arguments(parser)`` and
``run(args) -> int``; it is imported only when used, so ``hicache backends`` stays fast.
hicache errors are printed as one paragraph (no traceback) with exit code 2; a reader that closes
the pipe early (``hicache backends --json | head``) ends the command quietly with code 141; any
other failure to write (``> /dev/full``) is one line on stderr and exit code 1. A verb that left
non-daemon threads running (``args.hard_exit``) ends the process without waiting for them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import import_module

from ..errors import HiCacheError

__all__ = ["main"]

_VERBS = {
    "backends": "list installed backends with their status and capabilities",
    "check": "run the conformance suite against an installed backend",
    "bench": "back up, reopen, query, prefetch and verify a model profile; report GB/s vs raw I/O",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description="hicache: tiered KV-cache storage plugins")
    parser.add_argument("--version", action=_Version, nargs=0, help="print hicache's version and exit")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="{" + ",".join(_VERBS) + "}")
    for verb, help_text in _VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        import_module(f"hicache_core.cli.{verb}").add_arguments(p)
    return parser


class _Version(argparse.Action):
    """``--version``: reads the installed version only when asked (listing stays fast)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("hicache-core")
        except PackageNotFoundError:  # a source tree that is not installed
            found = "(not installed)"
        print(f"hicache {found}")
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_list:  # everything after `--` is passed through (for `check`)
        cut = args_list.index("--")
        args_list, extra = args_list[:cut], args_list[cut + 1 :]
    args = _parser().parse_args(args_list)
    args.passthrough = extra
    try:
        code: int = import_module(f"hicache_core.cli.{args.verb}").run(args)
        sys.stdout.flush()  # a closed pipe shows up here, not in the interpreter's exit
    except HiCacheError as err:
        print(f"hicache {args.verb}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `hicache backends --json | head`: the reader left, we stop quietly
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe
    except OSError as err:  # stdout on a full disk (`> /dev/full`), or another file that failed
        _silence_stdout()
        where = f": {err.filename}" if err.filename else " (writing standard output)"
        print(f"hicache {args.verb}: error: {err.strerror or err}{where}", file=sys.stderr)
        return 1
    if argv is None and getattr(args, "hard_exit", False):
        # the command's own process (the `hicache` script): threads the backend left running
        # (e.g. stuck past `check --test-timeout`) would block the interpreter's exit forever
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # pragma: no cover - stdout is not a real file
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
