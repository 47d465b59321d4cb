"""YAML + ${} interpolation + dotted overrides -> typed dataclasses, with errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from mcore_rl.config.loader import ConfigError, load_config, to_dict


@dataclass
class Optim:
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class Policy:
    temperature: float = 1.0
    max_new_tokens: int = 256
    load: Path | None = None
    optim: Optim = field(default_factory=Optim)


@dataclass
class Run:
    exp_name: str = "run"
    output_dir: str = "out"
    log_dir: str = "${output_dir}/logs"
    shuffle: bool = True
    mode: Literal["sync", "async"] = "sync"
    policy: Policy = field(default_factory=Policy)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_interpolation_overrides_and_types(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_ROOT", "/ckpt")
    path = _write(
        tmp_path,
        "exp_name: grpo\noutput_dir: /runs/${exp_name}\nlog_dir: ${output_dir}/tb\n"
        "policy:\n  load: ${env:CKPT_ROOT}/smol\n  max_new_tokens: 64\n  optim: {lr: 1}\n",
    )
    config = load_config(Run, path, ["policy.temperature=0.8", "exp_name=gspo", "policy.optim.betas=[0.9, 0.95]"])
    assert config.output_dir == "/runs/gspo" and config.log_dir == "/runs/gspo/tb"  # overrides before ${}
    assert config.policy.temperature == 0.8 and config.policy.max_new_tokens == 64
    assert config.policy.load == Path("/ckpt/smol")
    assert config.policy.optim.lr == 1.0 and isinstance(config.policy.optim.lr, float)
    assert config.policy.optim.betas == [0.9, 0.95]
    assert to_dict(config)["policy"]["load"] == "/ckpt/smol"


def test_defaults_take_part_in_interpolation(tmp_path):
    config = load_config(Run, _write(tmp_path, "output_dir: /runs/x\n"))
    assert config.log_dir == "/runs/x/logs"


def test_a_whole_value_reference_keeps_its_type(tmp_path):
    path = _write(tmp_path, "policy:\n  max_new_tokens: 32\n  optim: {betas: [0.5, 0.5]}\n")
    config = load_config(Run, path, ["policy.temperature=${policy.max_new_tokens}"])
    assert config.policy.temperature == 32.0


@pytest.mark.parametrize(
    "text,overrides,message",
    [
        ("policy:\n  temprature: 0.7\n", [], r"policy.temprature: unknown key; did you mean 'temperature'\?"),
        ("policy:\n  max_new_tokens: many\n", [], r"policy.max_new_tokens: expected int, got 'many' \(str\)"),
        ("shuffle: 1\n", [], r"shuffle: expected bool, got 1 \(int\)"),
        ("mode: eager\n", [], r"mode='eager': expected one of \['sync', 'async'\]"),
        ("policy:\n  optim: {betas: 0.9}\n", [], r"policy.optim.betas: expected a list, got 0.9"),
        ("log_dir: ${nowhere.key}\n", [], r"log_dir: \$\{nowhere.key\} refers to a key that does not exist"),
        ("exp_name: ${output_dir}\noutput_dir: ${exp_name}\n", [], r"circular reference"),
        ("exp_name: a\n", ["policy"], r"override 'policy': expected dotted.key=value"),
        ("exp_name: a\n", ["exp_name.x=1"], r"override 'exp_name.x=1': 'exp_name' is a value, not a section"),
        ("policy: ${env:MCORE_RL_SURELY_UNSET}\n", [], r"environment variable 'MCORE_RL_SURELY_UNSET'"),
    ],
)
def test_errors_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Run, _write(tmp_path, text), overrides)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = _write(tmp_path, "exp_name: a\npolicy:\n  temperature: [1, 2\n  max_new_tokens: 3\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+:\d+: malformed YAML"):
        load_config(Run, path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Run, tmp_path / "missing.yaml")
