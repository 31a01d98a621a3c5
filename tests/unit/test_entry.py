"""The entry points' shared start (services.common.entry): a config that does not load ends each
of them with exit status 2 and its problems on stderr, whichever entry point it is."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal

import pytest

from services.common import entry

ENTRY_POINTS = [
    ("services.trainer.__main__", [], "lorabus trainer"),
    ("services.rollout.__main__", ["--replica", "r0"], "lorabus rollout"),
    ("services.registry.__main__", [], "lorabus registry"),
    ("services.registry.__main__", ["status"], "lorabus registry status"),
    ("services.exporter.__main__", [], "lorabus exporter"),
    # these two let ConfigError escape as a traceback before they used `entry`
    ("services.clients.evaluate", [], "lorabus evaluate"),
    ("services.clients.watch", [], "lorabus watch"),
]


@pytest.mark.parametrize("module,first,prog", ENTRY_POINTS)
def test_a_config_error_exits_2_with_the_message(module, first, prog, tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main([*first, "--config", str(missing)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: config: file not found: {str(missing)!r}")


def test_a_bad_override_names_itself(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text("actor: {path: tiny}\ntrain_dataset: {path: 'builtin:arith'}\n")
    args = entry.parser("lorabus x", "x").parse_args(["--config", str(path), "rollout.replicas"])
    with pytest.raises(SystemExit) as info:
        entry.load_or_exit(args, "lorabus x")
    assert info.value.code == 2
    assert "override 'rollout.replicas' is not key=value" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_event_is_set_by_sigint_and_sigterm(sig):
    async def main() -> bool:
        stop = entry.stop_event()
        os.kill(os.getpid(), sig)
        await asyncio.wait_for(stop.wait(), 5)
        return stop.is_set()

    assert asyncio.run(main())


def test_run_uses_uvloop_where_installed_and_stops_on_a_signal():
    async def main() -> str:
        stop = entry.stop_event()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5)
        return type(asyncio.get_running_loop()).__module__

    loop_module = entry.run(main())
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert loop_module.startswith("asyncio")
    else:
        assert loop_module.startswith("uvloop")
