"""The peer: TRL's GRPOTrainer on the rl suite's settings, run inside the peer venv (benchmarks/peer/venv.py).

    python trl_grpo.py SETTINGS.json OUT.jsonl

SETTINGS.json (written by the rl suite): model, prompts (a JSONL of {"messages", "answer"} rows, the same prompts
in the same order mcore-rl trains on), prompts_per_episode, group_size, max_new_tokens, temperature, lr, steps per
episode, episodes, threads. One episode = one generation batch (prompts x group) and its optimizer steps, as
mcore-rl's. Writes one JSON line per episode (its seconds, the samples, the response tokens) and a "start" line
with the time (time.time()) the first episode starts.
"""

import json
import sys
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def main(settings_path: str, out_path: str) -> None:
    s = json.loads(open(settings_path).read())
    sys.path.insert(0, s["repo"])
    from mcore_rl.rewards.math import math_reward  # the same reward (plain Python, no project dependencies)

    torch.set_num_threads(s["threads"])
    rows = [json.loads(line) for line in open(s["prompts"])]
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **_):
        return [math_reward(c[-1]["content"], a) for c, a in zip(completions, answer, strict=True)]

    samples = s["prompts_per_episode"] * s["group_size"]
    steps = s["steps_per_episode"]
    config = GRPOConfig(
        output_dir=s["output_dir"],
        per_device_train_batch_size=samples // steps,
        gradient_accumulation_steps=1,
        steps_per_generation=steps,
        num_generations=s["group_size"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        learning_rate=s["lr"],
        beta=0.0,
        max_steps=steps * s["episodes"],
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        shuffle_dataset=False,
        seed=s["seed"],
    )
    out = open(out_path, "w")

    class Episodes(TrainerCallback):
        """Wall time per episode (its optimizer steps, with the generation the first one starts with)."""

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.time()
            out.write(json.dumps({"event": "start", "time": self.start}) + "\n")
            self.tokens = 0.0

        def on_log(self, args, state, control, logs=None, **kw):
            self.tokens += float((logs or {}).get("completions/mean_length", 0.0)) * samples  # once per generation

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % steps == 0:
                now = time.time()
                record = {"episode": state.global_step // steps, "seconds": now - self.start, "samples": samples}
                out.write(json.dumps(record | {"response_tokens": self.tokens}) + "\n")
                out.flush()
                self.start, self.tokens = now, 0.0

    trainer = GRPOTrainer(model=s["model"], reward_funcs=reward, args=config, train_dataset=dataset)
    trainer.add_callback(Episodes())
    trainer.train()
    out.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
