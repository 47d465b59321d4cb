"""The ``agent`` suite: does a tool help? The main job (SmolLM2-135M-Instruct, GRPO, the same command) on the
built-in multi-step word problems, once answering directly and once with the calculator tool (multi-turn: the
policy may call it, reads its result, then answers), by the built-in loop and by a plain agent program with the
``openai`` client through the run's endpoint (``benchmarks/calculator_agent.py``). Both runs have the same samples, lengths and optimizer; the
tool run's trajectories get up to ``max_turns`` turns of ``max_new_tokens`` each.

SmolLM2-135M-Instruct makes no well-formed tool call unprompted (0 of 32 samples; 3 of 32 with a worked example in
context), so RL alone has nothing to reinforce. As tool-use recipes do, each run starts from a short supervised
cold start in its own format, on training problems only (the tool run: a call with the problem's expression, then
the answer after the result; the direct run: the answer), with the same number of examples and steps.

Reported per run: the training reward per episode (its curve and its mean over the first and last quarter of the
episodes), greedy eval accuracy before and after, and for the tool run the turns, tool calls, tool errors, tool
latency and stop reasons per episode.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.hardware import Hardware
from benchmarks.report import Report, plot_rewards, pyplot, table
from benchmarks.rl import REPO, Variant

COMMON = (
    "runtime_args.data_path=builtin:word_problems",
    "runtime_args.eval_data_path=builtin:word_problems",
    "runtime_args.num_builtin_eval=64",
    "models.policy.max_prompt_tokens=128",
    "models.policy.rollout.max_model_len=640",
    "models.policy.rollout.cpu_kv_cache_bytes=1073741824",
    "models.policy.rollout.train.max_new_tokens=64",
    "models.policy.rollout.eval.max_new_tokens=64",
)
RUNS = (
    Variant("direct", "answers in one turn, no tool", overrides=COMMON),
    Variant(
        "calculator",
        "the calculator tool, up to 3 turns of 64 tokens",
        overrides=(*COMMON, "models.reward.tools=[calculator]", "models.policy.rollout.multi_turn.max_turns=3"),
    ),
    Variant(
        "openai-program",
        "the same loop as a plain program with the openai client (benchmarks/calculator_agent.py)",
        overrides=(
            *COMMON,
            "models.reward.agent=benchmarks/calculator_agent.py",
            "models.policy.rollout.multi_turn.max_turns=3",
        ),
    ),
)


COLD_START_EXAMPLES = 8
COLD_START_EPOCHS = 1


def cold_start_examples(tokenizer, tools: bool, count: int = COLD_START_EXAMPLES) -> list[tuple[list[int], list[int]]]:
    """``(token ids, loss mask)`` of ``count`` training problems answered in the run's format, built as the RL loop
    builds a trajectory (the same prompt, observation tokens and mask). The problems come after the runs' own
    (seed 1, 2000 train + 64 eval), so none is trained on or evaluated later."""
    from mcore_rl.agent.chat import ChatFormat
    from mcore_rl.agent.tools import Calculator, schema
    from mcore_rl.data.arithmetic import word_problem_splits

    chat = ChatFormat(tokenizer, [schema(Calculator())] if tools else [])
    examples = []
    for row in word_problem_splits(2064 + count, 0, seed=1)[0][2064:]:
        prompt = chat.prompt(row.messages)
        ids, mask = list(prompt), [0] * len(prompt)
        call = json.dumps({"name": "calculator", "arguments": {"expression": row.extra["expression"]}})
        turns = [f"<tool_call>\n{call}\n</tool_call>", row.answer] if tools else [row.answer]
        for i, text in enumerate(turns):
            turn = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            ids, mask = ids + turn, mask + [1] * len(turn)
            if i + 1 < len(turns):
                observation = chat.observation([{"role": "tool", "content": row.answer}], turn)
                ids, mask = ids + observation, mask + [0] * len(observation)
        examples.append((ids, mask))
    return examples


def cold_start(out_dir: Path, tools: bool) -> Path:
    """SmolLM2-135M-Instruct fine-tuned on :func:`cold_start_examples` (one pass, one example per step)."""
    import shutil

    import torch
    import transformers

    from benchmarks.rl import main_model

    source = main_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
    for _ in range(COLD_START_EPOCHS):
        for ids, mask in cold_start_examples(tokenizer, tools):
            labels = [t if m else -100 for t, m in zip(ids, mask, strict=True)]
            model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (Path(source) / name).exists():
            shutil.copy(Path(source) / name, out_dir / name)
    return out_dir


def run(variant: Variant, out: Path, episodes: int) -> dict:
    """The variant's episodes (metrics.jsonl records) and eval accuracies, from the user's command."""
    import subprocess

    directory = out / "runs" / f"agent-{variant.name}"
    model = cold_start(out / "runs" / f"agent-{variant.name}-cold-start", tools=variant.name != "direct")
    args = [
        f"models.policy_trainer.load={model}",
        f"runtime_args.output_dir={directory}",
        f"runtime_args.num_episode={episodes}",
        "runtime_args.save_episode_interval=0",
        f"runtime_args.eval_episode_interval={episodes}",
        *variant.overrides,
    ]
    log = out / "runs" / f"agent-{variant.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        subprocess.run(["bash", variant.script, *args], cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT)
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    episodes_ = [r for r in records if "event" not in r and "reward/mean" in r]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return {"name": variant.name, "what": variant.what, "episodes": episodes_, "evals": evals}


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.mean(values) if values else 0.0


def suite(out: Path, hardware: Hardware, report: Report, episodes: int) -> None:
    del hardware  # the rl suite reports the machine; this one compares rewards
    results = [run(v, out, episodes) for v in RUNS]
    quarter = max(1, episodes // 4)
    rows = []
    for r in results:
        eps = r["episodes"]
        rows.append(
            [
                r["name"], r["what"], f"{_mean(eps[:quarter], 'reward/mean'):.3f}",
                f"{_mean(eps[-quarter:], 'reward/mean'):.3f}", f"{r['evals'][0]:.3f}", f"{r['evals'][-1]:.3f}",
                f"{_mean(eps, 'time/episode'):.1f}",
            ]
        )  # fmt: skip
    tools = next(r for r in results if r["name"] == "calculator")["episodes"]
    keys = ("turns_mean", "tool_calls_mean", "tool_errors", "tool_latency_mean_s", "stop_done_fraction",
            "stop_max_turns_fraction", "stop_length_fraction", "stop_max_tokens_fraction")  # fmt: skip
    tool_rows = [
        [label, *(f"{_mean(part, f'agent/{k}'):.3g}" for k in keys)]
        for label, part in (("first quarter", tools[:quarter]), ("last quarter", tools[-quarter:]), ("all", tools))
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    plot_rewards(ax, results)
    report.add(
        "agent: multi-step word problems with and without the calculator tool",
        f"SmolLM2-135M-Instruct after a {COLD_START_EXAMPLES}-example cold start in each run's format, the main job's "
        f"GRPO settings, {episodes} episodes of 32 samples on "
        "`builtin:word_problems`; eval: greedy accuracy on 64 held-out problems before the first and after the last "
        "episode. Reward: the math reward (1 for the right number).",
        table(
            ["run", "what", "reward, first quarter", "reward, last quarter", "eval before", "eval after", "s/episode"],
            rows,
        ),  # fmt: skip
        "Tool run, per trajectory (tool errors: per episode):",
        table(["episodes", *keys], tool_rows),
        report.figure(fig, "agent_reward", "training reward per episode"),
    )
