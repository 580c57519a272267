"""`python -m speechlm.train CONFIG [--cp-size C] [--tp-size T] [overrides]` (what torchrun launches)."""

import argparse
import sys

from speechlm.config import parse_command_line
from speechlm.errors import run_guarded
from speechlm.train.entry import OVERRIDES_HELP, add_train_arguments, run_train_command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m speechlm.train",
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(p)
    p.add_argument("--debug", action="store_true", help="print the traceback of user errors too")
    args = parse_command_line(p, argv)  # dotted overrides may come after options
    return run_guarded(lambda: run_train_command(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
