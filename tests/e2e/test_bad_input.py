"""Bad input to ``python -m mcore_rl.train`` is refused before any actor starts: exit status 2, one ``error:`` line
naming the key or file and what was expected, no traceback, and the output directory of an earlier run untouched
(no new file, not even a ``config.N.yaml``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.config.schema import load_run_config
from mcore_rl.train import main
from tests.e2e.test_rl_run import REPO, write_config

EARLIER = {"config.yaml": "earlier: run\n", "metrics.jsonl": '{"episode": 1}\n'}


@pytest.fixture()
def bad_run(tiny_models, tmp_path):
    """A valid run config whose output directory holds an earlier run's files."""
    path = write_config(tmp_path, tiny_models["Qwen3ForCausalLM"], "bad")
    out = tmp_path / "runs" / "bad"
    out.mkdir(parents=True)
    for name, text in EARLIER.items():
        (out / name).write_text(text)
    return path, out


def _refused(bad_run, capsys, overrides: list[str], message: str) -> None:
    path, out = bad_run
    assert main([str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err
    assert {p.name: p.read_text() for p in out.iterdir()} == EARLIER


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


ROW = {"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}


@pytest.mark.parametrize("key", ["data_path", "eval_data_path"])
@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("malformed.jsonl", json.dumps(ROW) + "\n{not json\n", ":2: malformed JSON"),
        ("empty.jsonl", "", ": no rows"),
        (
            "no_answer.jsonl",
            json.dumps({"messages": ROW["messages"]}) + "\n",
            ":1: 'answer' must be a string or a number",
        ),
        ("x.parquet", "this is text, not Parquet\n", ": not a readable Parquet file"),
    ],
)
def test_bad_data_files(bad_run, capsys, tmp_path, key, name, content, expected):
    data = _write(tmp_path / name, content)
    _refused(bad_run, capsys, [f"runtime_args.{key}={data}"], f"runtime_args.{key}='{data}': {data}{expected}")


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        ("'1.0'", "returned '1.0' (str)"),
        ("True", "returned True (bool)"),
        ("None", "returned None"),
        ("float('nan')", "returned nan"),
    ],
)
def test_reward_functions_that_return_no_number(bad_run, capsys, tmp_path, result, problem):
    reward = _write(tmp_path / "reward.py", f"def reward_fn(messages, answer):\n    return {result}\n")
    _refused(
        bad_run,
        capsys,
        [f"models.reward.fn={reward}"],
        f"models.reward.fn='{reward}' {problem} on sample start-up check (the first training prompt, answered with its "
        "reference answer); expected a finite real number",
    )


def test_truncated_weights_are_named(bad_run, capsys, tmp_path, tiny_models):
    model = Path(shutil.copytree(tiny_models["Qwen3ForCausalLM"], tmp_path / "truncated"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    _refused(
        bad_run,
        capsys,
        [f"models.policy_trainer.load={model}"],
        f"models.policy_trainer.load='{model}': {weights}: truncated",
    )


@pytest.mark.parametrize(
    ("family", "problem"),
    [
        ("LlamaForCausalLM", "its tokenizer does not load"),
        ("Qwen3ForCausalLM", "its tokenizer holds no token but its special ones"),
    ],
)
def test_a_model_directory_without_its_tokenizer_is_named(bad_run, capsys, tmp_path, tiny_models, family, problem):
    """Without its tokenizer files, a Llama's tokenizer fails to load and a Qwen's loads empty (transformers 5):
    both are refused by the key."""
    model = Path(shutil.copytree(tiny_models[family], tmp_path / "untokenized"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    _refused(bad_run, capsys, [f"models.policy_trainer.load={model}"], f"models.policy.load='{model}': {problem}")


def test_bad_command_lines(bad_run, capsys, tmp_path):
    cases = [
        (["runtime_args.num_devices=3"], "models.policy_trainer.parallel"),
        (["models.policy_trainer.micro_batch_size=five"], "micro_batch_size: expected int, got 'five'"),
        (["models.policy.load=/nowhere"], "models.policy.load='/nowhere': no config.json"),
        (["runtime_args.data_path=/nowhere.jsonl"], "runtime_args.data_path='/nowhere.jsonl': file not found"),
        ([f"models.reward.fn={tmp_path}/missing.py"], f"models.reward.fn='{tmp_path}/missing.py': file"),
        (["models.policy.rollout.train.max_new_tokens=0"], "models.policy.rollout.train.max_new_tokens=0: expected"),
    ]
    for overrides, message in cases:
        _refused(bad_run, capsys, overrides, message)


def test_smollm2_tp_advice_lists_sizes_that_split_both_head_counts(bad_run, capsys):
    """9 query heads and 3 KV heads: TP 9 would fail on the KV heads, so it is not offered."""
    from converters.gguf2hf import default_model_dir

    overrides = [f"models.policy_trainer.load={default_model_dir()}", "models.policy_trainer.parallel.tp=2"]
    _refused(bad_run, capsys, overrides, "num_attention_heads=9 is not divisible by tp=2; choose tp among [1, 3]\n")


def test_numbers_load_as_people_write_them(tmp_path, tiny_models):
    """YAML 1.1 reads 1e-5 as a string; the loader reads floats as YAML 1.2 does, in files and overrides."""
    path = write_config(tmp_path, tiny_models["Qwen3ForCausalLM"], "floats")
    path.write_text(path.read_text().replace("optimizer: {lr: 1.0e-3}", "optimizer: {lr: 1e-5, min_lr: 1E-7}"))
    config = load_run_config(path, ["models.policy_trainer.optimizer.weight_decay=2e-5"])
    optimizer = config.models.policy_trainer.optimizer
    assert (optimizer.lr, optimizer.min_lr, optimizer.weight_decay) == (1e-5, 1e-7, 2e-5)
    config = load_run_config(path, ["models.policy_trainer.optimizer.lr=2e-5"])  # the README's own example
    assert config.models.policy_trainer.optimizer.lr == 2e-5


def test_the_command_prints_one_error_line_and_no_traceback(bad_run):
    """The same through the real command (its own process): what a user sees."""
    path, out = bad_run
    run = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", str(path), "runtime_args.data_path=/nowhere.jsonl"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: runtime_args.data_path='/nowhere.jsonl': file not found (or use one of ['builtin:arithmetic', "
        "'builtin:word_problems'])"
    ]
    assert "Traceback" not in run.stderr and "warn" not in run.stderr.lower(), run.stderr
    assert {p.name: p.read_text() for p in out.iterdir()} == EARLIER


@pytest.mark.parametrize(
    ("env", "tools", "message"),
    [
        ("class Environment:\n    def reset(self, row):\n        raise KeyError('level')\n    def step(self, m):\n"
         "        return [], 1.0, True\n", "", "(row 'train-"),
        ("class Environment:\n    def reset(self, row):\n        return 'hello'\n    def step(self, m):\n"
         "        return [], 1.0, True\n", "", "reset returned 'hello'; expected a list of {'role', 'content'} dicts"),
        ("class Environment:\n    def reset(self, row):\n        return row['messages']\n    def step(self, m):\n"
         "        return [], 'good', True\n", "", "step returned the reward 'good'; expected a finite real number"),
        ("Environment = 3\n", "", "is not a class with reset(row) and step(message) methods"),
        ("", "class T:\n    name = 't'\n    parameters = {'type': 'object'}\n", "is not a tool: it lacks call"),
    ],
)  # fmt: skip
def test_environments_and_tools_that_cannot_run_are_refused(bad_run, capsys, tmp_path, env, tools, message):
    overrides = []
    if env:
        overrides.append(f"models.reward.env={_write(tmp_path / 'env.py', env)}")
    if tools:
        overrides.append(f"models.reward.tools=[{_write(tmp_path / 'tools.py', tools)}:T]")
    _refused(bad_run, capsys, overrides, message)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("import no_such_module\n", "importing"),
        (
            "def walk(base_url, api_key, row):\n    return 1.0\n",
            "has no 'run'; define a function run(base_url, api_key",
        ),
    ],
)
def test_agent_programs_that_cannot_load_are_refused(bad_run, capsys, tmp_path, source, message):
    _refused(bad_run, capsys, [f"models.reward.agent={_write(tmp_path / 'agent.py', source)}"], message)
