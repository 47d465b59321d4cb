"""The template audit: a synthetic conversation rendered incrementally and whole, every context a prefix of the
next, or the first differing token and the fix named, before any actor of a multi-turn run starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from converters.gguf2hf import default_model_dir
from mcore_rl.agent.template_audit import CALCULATOR, audit
from mcore_rl.config.loader import ConfigError
from mcore_rl.config.schema import RunConfig
from mcore_rl.preflight import check_template
from tests.tiny import CHAT_TEMPLATE, save_char_tokenizer
from tests.unit.test_chat_format import QWEN3_LIKE, QWEN_LIKE, TEMPLATES

REPO = Path(__file__).resolve().parents[2]
# The verdict on every template in the tree (README's table): "appends", or where the first mismatch is, or the
# start of the template's refusal.
VERDICTS = {
    "tiny ChatML (tests/tiny.py)": (CHAT_TEMPLATE, "appends"),
    "Qwen2.5-like (tests/unit/test_chat_format.py)": (QWEN_LIKE, "appends"),
    "Qwen3-like (tests/unit/test_chat_format.py)": (
        QWEN3_LIKE,
        "drops earlier turns' reasoning): the prompt of assistant turn 2 does not continue assistant turn 1",
    ),
    "deepseek_v3.jinja": (
        "deepseek_v3.jinja",
        "renders an earlier turn differently): assistant turn 1 as the last message does not continue the prompt of "
        "assistant turn 1",
    ),
    "glm45.jinja": (
        "glm45.jinja",
        "drops earlier turns' reasoning): the prompt of assistant turn 3 does not continue assistant turn 2",
    ),
    "gpt_oss.jinja": ("gpt_oss.jinja", "refuses the audit's conversation: the chat template refuses tool messages"),
    "kimi_k2_thinking.jinja": (
        "kimi_k2_thinking.jinja",
        "drops earlier turns' reasoning): assistant turn 2 as the last message does not continue the prompt of "
        "assistant turn 2",
    ),
    "llama3.1_json.jinja": ("llama3.1_json.jinja", "appends"),
    "mistral_small_3.1.jinja": (
        "mistral_small_3.1.jinja",
        "renders an earlier turn differently): the prompt of assistant turn 3 does not continue assistant turn 2",
    ),
    "qwen3_coder.jinja": ("qwen3_coder.jinja", "appends"),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny models' character tokenizer: each template is rendered with it, so a token is a character."""
    out = tmp_path_factory.mktemp("tokenizer")
    save_char_tokenizer(out)
    return transformers.AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_every_template_in_the_tree_gets_its_verdict(tokenizer, name):
    template, expected = VERDICTS[name]
    tokenizer.chat_template = (TEMPLATES / template).read_text() if template.endswith(".jinja") else template
    verdict = audit(tokenizer)
    assert verdict.appends == (expected == "appends") and expected in verdict.describe(), verdict.describe()


def test_the_embedded_model_s_template_appends():
    """SmolLM2's template ignores tools: the audit renders them as the run gives them (Hermes instructions)."""
    smollm2 = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    assert audit(smollm2).appends and audit(smollm2, tools=[]).appends


def test_a_template_that_strips_earlier_thinking_is_refused_with_the_token_and_the_fix(tokenizer):
    """Qwen3's rule: the reasoning of turns before the last user message is dropped once another follows. The
    run's check names the first token that differs (the kept <think> block's '<' against the answer's 'I') and the
    fix, before any actor starts; with rewritten_history: new_sample the run goes on (each rewritten context a new
    training sample)."""
    tokenizer.chat_template = QWEN3_LIKE
    verdict = audit(tokenizer)
    assert not verdict.appends and verdict.mismatch.drops_reasoning
    assert (verdict.mismatch.expected, verdict.mismatch.got) == ("<", "I")
    config = RunConfig()
    with pytest.raises(ConfigError) as refused:
        check_template(config, [], tokenizer)
    message = str(refused.value)
    assert "its chat template rewrites the history (drops earlier turns' reasoning)" in message
    assert "first differing token #" in message and "'<' there, 'I' here" in message
    assert "Fix: models.policy.rollout.multi_turn.rewritten_history: new_sample" in message
    config.models.policy.rollout.multi_turn.rewritten_history = "new_sample"
    check_template(config, [], tokenizer)
    # gpt-oss's template refuses a tool result after a turn whose call it did not write: refused whatever the setting
    tokenizer.chat_template = (TEMPLATES / "gpt_oss.jinja").read_text()
    with pytest.raises(ConfigError, match="refuses the audit's conversation"):
        check_template(config, [CALCULATOR], tokenizer)


def test_the_command_audits_a_model_directory(tmp_path):
    model = tmp_path / "model"
    save_char_tokenizer(model)
    command = [sys.executable, "-m", "mcore_rl.agent.template_audit"]
    run = subprocess.run([*command, str(model)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and f"{model}: appends" in run.stdout, run.stdout + run.stderr
    assert run.stderr == ""  # nothing of Megatron-Core is imported (its warnings on import)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = QWEN3_LIKE
    tokenizer.save_pretrained(model)
    run = subprocess.run([*command, str(model)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "rewrites the history" in run.stdout, run.stdout + run.stderr
    run = subprocess.run([*command, str(tmp_path / "none")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "not a directory" in run.stderr
