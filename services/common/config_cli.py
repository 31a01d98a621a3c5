"""`lorabus config translate FILE [key=value ...]`: print the native lorabus YAML that an AReaL
experiment file (or a native one) amounts to, so a user can switch for good.

The translation table goes to stderr, the YAML to stdout: `lorabus config translate a.yaml >
native.yaml` keeps only the config. The printed file holds every value resolved, derived
defaults included, and loads to the same config (a test checks this).
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec
import yaml

from services.common import areal
from services.common.config import load_config


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="lorabus config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("translate", help="print the equivalent native lorabus YAML")
    t.add_argument("file")
    t.add_argument("overrides", nargs="*", help="native key=value overrides")
    args = p.parse_args(argv)
    os.environ.pop(areal.REPORTED_ENV, None)  # the table is what this command is for
    cfg = load_config(args.file, args.overrides)
    print(f"# lorabus config translated from {args.file}", file=sys.stdout)
    sys.stdout.write(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    return 0
