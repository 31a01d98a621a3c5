"""`lorabus up --trainer-site`: which megatron-bridge site the trainer (and only it) gets."""

from __future__ import annotations

import pytest

from services.config.loader import config_from_dict
from services.local import launcher, trainer_site


def _cfg(backend: str):
    actor = {"backend": backend, "path": "examples/tiny/model", "megatron": {"bridge_type": "megatron-bridge"}}
    return config_from_dict({"actor": actor, "train_dataset": {"path": "builtin:arith"}})


def _site(root):
    (root / "megatron" / "bridge").mkdir(parents=True)
    return root


def test_given_site_must_hold_megatron_bridge(tmp_path):
    with pytest.raises(trainer_site.BadTrainerSite, match=r"--trainer-site: .* holds no megatron/bridge package; give"):
        trainer_site.trainer_site(_cfg("megatron"), str(tmp_path))
    assert trainer_site.trainer_site(_cfg("fsdp2"), str(_site(tmp_path / "s"))) == str(tmp_path / "s")


def test_default_site_only_for_megatron_without_bridge(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trainer_site, "_has_bridge", lambda: False)
    monkeypatch.setattr(trainer_site, "__file__", str(tmp_path / "services" / "local" / "trainer_site.py"))
    assert trainer_site.trainer_site(_cfg("megatron"), None) is None  # nothing to take
    _site(tmp_path / trainer_site.DEFAULT_MEGATRON_SITE)
    assert trainer_site.trainer_site(_cfg("megatron"), None) == str(tmp_path / trainer_site.DEFAULT_MEGATRON_SITE)
    assert trainer_site.trainer_site(_cfg("fsdp2"), None) is None
    monkeypatch.setattr(trainer_site, "_has_bridge", lambda: True)  # the launcher's own packages do
    assert trainer_site.trainer_site(_cfg("megatron"), None) is None


def test_site_goes_first_on_the_trainers_path_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = trainer_site.trainer_env(str(tmp_path))
    assert env == {"PYTHONPATH": f"{tmp_path}:/elsewhere"}
    assert trainer_site.trainer_env(None) == {}
    children = launcher.child_commands(_cfg("megatron"), "x.yaml", [], tmp_path, evaluate=True)
    trainer_site.give_trainer(children, str(tmp_path))
    assert {c.name: c.env_extra.get("PYTHONPATH") for c in children} == {
        c.name: (env["PYTHONPATH"] if c.name == "trainer" else None) for c in children
    }
    args = launcher.parse_args(["--config", "x.yaml", "--trainer-site", str(tmp_path)])
    assert args.trainer_site == str(tmp_path)
