"""`python -m speechlm.train CONFIG [--cp-size C] [--tp-size T] [overrides]` (what torchrun launches)."""

import argparse
import sys

from speechlm.train.entry import OVERRIDES_HELP, add_train_arguments, run_train_command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m speechlm.train",
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(p)
    return run_train_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
