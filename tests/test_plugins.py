"""Plugins: a user's own victim, registered in their own module, used by the plain CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from gradleak.cli import main

PLUGIN = textwrap.dedent('''
    from gradleak.victims import register_victim
    from gradleak.victims.mlp import MLPVictim


    @register_victim("{name}")
    class UsersVictim(MLPVictim):
        """A user's model, registered under their own name."""
''')
CAPTURE = ["capture", "--random-init", "--scenes", "heldout", "--steps", "6", "--seed", "1",
           "--set", "env.doomnav.frame_size=32", "--set", "env.doomnav.max_steps=6",
           "--set", "env.heldout_maps=MAP05", "--set", "env.max_regions_per_map=1", "--json"]


def write_plugin(folder: Path, module: str, victim: str) -> None:
    (folder / f"{module}.py").write_text(PLUGIN.format(name=victim))


def test_a_plugin_module_registers_a_victim_for_the_cli(capsys, monkeypatch,
                                                        tmp_path: Path) -> None:
    write_plugin(tmp_path, "users_victims", "users-mlp")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "c.h5"
    assert main([*CAPTURE, "--victim", "users-mlp", "--out", str(out)]) == 2
    assert "got 'users-mlp'" in capsys.readouterr().err  # not registered without it
    assert main([*CAPTURE, "--victim", "users-mlp", "--out", str(out), "--plugin",
                 "users_victims"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 6


def test_an_entry_point_plugin_loads_without_a_flag(capsys, monkeypatch,
                                                    tmp_path: Path) -> None:
    write_plugin(tmp_path, "installed_victims", "installed-mlp")
    dist = tmp_path / "users_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: users-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[gradleak.plugins]\nmine = installed_victims\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main([*CAPTURE, "--victim", "installed-mlp", "--out", str(tmp_path / "c.h5")]) == 0


def test_a_plugin_that_cannot_be_imported_is_one_line(capsys, tmp_path: Path) -> None:
    assert main(["info", "x.h5", "--plugin", "no_such_plugin_module"]) == 2
    err = capsys.readouterr().err
    assert "--plugin no_such_plugin_module: cannot import it" in err
    assert len(err.strip().splitlines()) == 1


@pytest.fixture(autouse=True)
def forget_plugins(monkeypatch):
    """Each test loads its plugins afresh (the registry itself keeps what they add)."""
    from gradleak import plugins

    monkeypatch.setattr(plugins, "_loaded", set())
