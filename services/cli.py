"""`lorabus <command> ...`: one subcommand per service plus the operator tools.

Each command is the `main(argv)` of a module, imported only when chosen, so `lorabus registry`
never pays for importing torch.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "registry": ("services.registry.__main__", "version ledger and off-policyness policy"),
    "trainer": ("services.trainer.__main__", "LoRA RL trainer (fsdp2 | megatron)"),
    "rollout": ("services.rollout.__main__", "rollout service (embedded | vllm | sglang)"),
    "exporter": ("services.exporter.__main__", "writes every version as a PEFT directory"),
    "up": ("services.local.launcher", "start a whole local deployment"),
    "run": ("services.clients.runs", "submit, list, stop or resume the runs of a running fleet"),
    "watch": ("services.clients.watch", "print the run's events live"),
    "evaluate": ("services.clients.evaluate", "score every new version, publish the result"),
    "streams": ("services.clients.streams", "create or update the run's streams (the operator)"),
    "config": ("services.config.cli", "translate FILE: an AReaL YAML as native lorabus YAML"),
}


def usage() -> str:
    lines = ["usage: lorabus <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`lorabus <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lorabus: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from services.config.loader import ConfigError

    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except ConfigError as exc:
        # a config mistake is the user's to fix: the message names the field, no traceback
        print(f"lorabus {name}: invalid config\n{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
