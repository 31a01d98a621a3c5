"""`lorabus config translate FILE [key=value ...]`: print the native lorabus YAML that an AReaL
experiment file (or a native one) amounts to, so a user can switch for good.

The translation table goes to stderr, the YAML to stdout: `lorabus config translate a.yaml >
native.yaml` keeps only the config. The printed file holds every value resolved, derived
defaults included, and loads to the same config (a test checks this). It reads no dataset and
needs no network: a length in epochs is printed as epochs (`total_train_epochs`), which become
steps when a service loads the file with its data; `total_train_steps` is printed with it only
where the file or an override wrote it.
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec
import yaml

from services.config import areal
from services.config.loader import load_config, read_tree


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="lorabus config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("translate", help="print the equivalent native lorabus YAML")
    t.add_argument("file")
    t.add_argument("overrides", nargs="*", help="key=value overrides (AReaL's key names in an AReaL file)")
    args = p.parse_args(argv)
    os.environ.pop(areal.REPORTED_ENV, None)  # the table is what this command is for
    cfg = load_config(args.file, args.overrides, read_data=False)
    out = msgspec.to_builtins(cfg)
    if cfg.total_train_epochs is not None and not _steps_written(args.file, args.overrides):
        del out["total_train_steps"]
    print(f"# lorabus config translated from {args.file}", file=sys.stdout)
    sys.stdout.write(yaml.safe_dump(out, sort_keys=False))
    return 0


def _steps_written(file: str, overrides: list[str]) -> bool:
    tree = read_tree(file)
    if areal.is_areal(tree):
        tree = areal.translate(tree).tree
    return "total_train_steps" in tree or any(o.partition("=")[0].strip() == "total_train_steps" for o in overrides)
