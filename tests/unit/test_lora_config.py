"""A LoRA run resumes (or continues from converted adapters) only from a checkpoint with its own adapters'
settings: any other is named with the fix."""

import json
import types

import pytest

from mcore_rl.trainer.policy import PolicyTrainer
from models.lora import LoRAConfig


@pytest.mark.parametrize(
    ("saved", "ours", "message"),
    [
        (
            {"rank": 8, "alpha": 16.0},
            LoRAConfig(rank=4, alpha=16.0),
            r"holds LoRA rank 8, alpha 16.0, but .* gives LoRA rank 4",
        ),
        ({"rank": 8, "alpha": 16.0}, LoRAConfig(), r"holds LoRA rank 8, alpha 16.0, but .* gives no LoRA adapters"),
        (None, LoRAConfig(rank=8), r"holds no LoRA adapters, but models.policy_trainer.lora gives LoRA rank 8"),
    ],
)
def test_a_checkpoint_with_other_adapters_is_refused(tmp_path, saved, ours, message):
    settings = tmp_path / "lora.json"
    if saved:
        settings.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=message + r".*; set it as the checkpoint's to resume"):
        PolicyTrainer._check_lora(types.SimpleNamespace(lora=ours), settings, "to resume")
    if saved:
        PolicyTrainer._check_lora(types.SimpleNamespace(lora=LoRAConfig(**saved)), settings, "")  # its own: fine
    PolicyTrainer._check_lora(types.SimpleNamespace(lora=LoRAConfig()), tmp_path / "none.json", "")  # neither has any


def test_routers_trained_beside_the_adapters_must_match_on_resume(tmp_path):
    """A run may train the routers of adapters that kept them frozen (it continues from them: its copies of the
    routers start from theirs), never resume them so, nor continue without training routers that trained."""
    settings = tmp_path / "lora.json"
    frozen, trained = LoRAConfig(rank=8, alpha=16.0), LoRAConfig(rank=8, alpha=16.0, train_router=True)
    settings.write_text(json.dumps(frozen.settings()))
    PolicyTrainer._check_lora(types.SimpleNamespace(lora=trained), settings, "", continuing=True)
    with pytest.raises(ValueError, match=r"holds LoRA rank 8, alpha 16.0, but .* gives LoRA rank 8, alpha 16.0, tr"):
        PolicyTrainer._check_lora(types.SimpleNamespace(lora=trained), settings, "to resume")
    settings.write_text(json.dumps(trained.settings()))
    assert json.loads(settings.read_text())["train_router"] is True
    with pytest.raises(ValueError, match=r"holds LoRA rank 8, alpha 16.0, trained routers, but .* gives LoRA rank 8"):
        PolicyTrainer._check_lora(types.SimpleNamespace(lora=frozen), settings, "", continuing=True)
