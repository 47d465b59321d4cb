"""The ``checkpoint`` suite: the policy trainer's checkpoint, saved and resumed (SmolLM2-135M-Instruct in fp32 at
data parallel 2: two processes of one core and one thread each, after one GRPO step so that Adam's state exists).

Two layouts of the optimizer's state: as each rank holds it (the default; every rank writes its own at once) and
gathered to data-parallel rank 0 and written per parameter (``runtime_args.save_reshardable``), alternating. Per
save and per load: the seconds until both ranks are done, the bytes written, and GB/s against the disk write the
run measured first (a file written and fsynced; Megatron's writer leaves the fsync to the run's commit, so a save
can beat it). A run's whole save adds that commit's fsyncs and the model files (its ``checkpoint`` event records
those seconds).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks import free_port
from benchmarks.report import Report, table

LAYOUTS = {False: "per rank (default)", True: "gathered (save_reshardable)"}


def _step_batch() -> dict:
    """The main job's step shape: 4 prompts of 45 tokens, 4 samples of 16 tokens each."""
    generator = torch.Generator().manual_seed(0)
    prompts, samples, prompt, response = 4, 4, 45, 16
    rows = prompts * samples
    tokens = torch.randint(10, 40000, (prompts, prompt), generator=generator).repeat_interleave(samples, 0)
    tokens = torch.cat([tokens, torch.randint(10, 40000, (rows, response), generator=generator)], 1)
    mask = torch.zeros(rows, prompt + response - 1)
    mask[:, prompt - 1 :] = 1
    return {
        "tokens": tokens,
        "lengths": torch.full((rows,), prompt + response),
        "prompt_lengths": torch.full((rows,), prompt),
        "mask": mask,
        "advantages": torch.randn(rows, generator=generator),
    }


def _rank(rank: int, world: int, port: int, hf_dir: str, scratch: str, repeats: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from mcore_rl.config.schema import OptimizerSettings, TrainerConfig
    from mcore_rl.trainer.policy import PolicyTrainer

    section = TrainerConfig(load=hf_dir, optimizer=OptimizerSettings(lr=1e-5), share_prompts=True)
    trainer = PolicyTrainer(rank, world, ("127.0.0.1", port), section, 1, 10)
    batch = _step_batch()
    batch["rollout_logp"] = trainer.logprobs(batch, micro_batch_size=4) * batch["mask"]
    trainer.train(batch, global_batch_size=len(batch["tokens"]), micro_batch_size=4)
    barrier = torch.distributed.barrier
    for i in range(repeats):
        for reshardable in LAYOUTS:
            directory = Path(scratch) / f"{i}-{reshardable}"
            if rank == 0:
                directory.mkdir(parents=True)
            barrier()
            start = time.perf_counter()
            trainer.save(str(directory), reshardable)
            barrier()
            saved = time.perf_counter() - start
            trainer.load(str(directory))
            barrier()
            loaded = time.perf_counter() - start - saved
            if rank == 0:
                size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
                results.put((reshardable, saved, loaded, size))
                shutil.rmtree(directory)
    torch.distributed.destroy_process_group()


def measure(scratch: Path, repeats: int = 3) -> dict[bool, list[tuple[float, float, int]]]:
    """(save seconds, load seconds, bytes) of each save per layout: ``repeats`` of each, alternating."""
    from converters.gguf2hf import default_model_dir

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    args = (2, free_port(), str(default_model_dir()), str(scratch), repeats, results)
    mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn")
    measured = {reshardable: [] for reshardable in LAYOUTS}
    while not results.empty():
        reshardable, saved, loaded, size = results.get()
        measured[reshardable].append((saved, loaded, size))
    return measured


def suite(out: Path, hardware, report: Report) -> None:
    scratch = out / "checkpoint"
    shutil.rmtree(scratch, ignore_errors=True)
    measured = measure(scratch)
    rows = []
    for reshardable, name in LAYOUTS.items():
        saves, loads, sizes = zip(*measured[reshardable], strict=True)
        gb = statistics.median(sizes) / 1e9
        save = statistics.median(saves)
        rows.append([name, len(saves), min(saves), save, min(loads), statistics.median(loads), gb, gb / save,
                     gb / save / hardware.disk_write_gbps])  # fmt: skip
    report.add(
        "checkpoint: the policy trainer's save and resume",
        __doc__.split("\n\n")[0].replace("\n", " "),
        table(
            [
                "optimizer state",
                "saves",
                "save s min",
                "save s median",
                "load s min",
                "load s median",
                "GB",
                "save GB/s (median)",
                "of disk write",
            ],
            rows,
        ),  # fmt: skip
    )
