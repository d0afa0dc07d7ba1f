"""``tensorferry <verb>``: demo, info, and the monitor's ``monitor`` and ``top``.

Errors go to stderr as ``ErrorType: message``; exit 0 on success, 1 on
failure, 2 on bad usage. Each verb imports what it needs when it runs, so
``tensorferry top`` never imports torch.

The top layer: may import anything in the package; nothing imports it
(``_info``, ``_demo``, ``_demo_transfer``, ``_synthetic`` are its verbs'
helpers).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from .. import __version__
from ..errors import ConfigurationError, TensorferryError

__all__ = ["main", "build_parser"]


def _cmd_info(args: argparse.Namespace) -> int:
    from ._info import info_rows

    width = max(len(k) for k, _ in info_rows())
    for key, value in info_rows():
        print(f"{key:<{width}}  {value}")
    return 0


def _check_demo(args: argparse.Namespace) -> None:
    from ._demo import check_demo_args

    check_demo_args(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(args)


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line ``UsageError: message``
    on stderr and exit 2 (an unknown option, a missing value, a bad int)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"UsageError: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tensorferry",
        description="Move many PyTorch tensors between processes and hosts at memory speed.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"tensorferry {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="<verb>", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("info", help="versions and which optional backends are available")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="pack, ship and verify a synthetic ~1 GiB state dict")
    p.add_argument("-s", "--size-mib", type=int, default=1024, help="state dict size in MiB (default 1024)")
    p.add_argument("-n", "--tensors", type=int, default=3000, help="number of tensors (default 3000)")
    p.add_argument("-r", "--repeats", type=int, default=3, help="syncs per transport (default 3)")
    p.add_argument(
        "-t",
        "--transports",
        default="auto",
        help="comma-separated transports to run (pool,shm,tcp,nixl), or auto for all available",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_demo, check=_check_demo)

    try:
        from ..monitor import add_subcommands
    except ImportError:
        pass
    else:
        add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:
        # Values argparse cannot judge alone (ranges, what this machine has)
        # are usage errors too: checked before the verb builds anything.
        try:
            check(args)
        except ConfigurationError as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    try:
        return int(args.func(args) or 0)
    except TensorferryError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 1
