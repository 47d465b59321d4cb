"""Rollout and sync settings are checked up front, with errors that name the field and what was expected."""

from __future__ import annotations

import pytest

from mcore_rl.rollout.engine import RolloutConfig, SamplingConfig, cpu_thread_binding, tokenizer_eos_ids
from mcore_rl.trainer.sync import SyncConfig, engine_probe_rows, probe_tokens


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("n", 0, r"rollout.train.n=0: expected at least 1"),
        ("temperature", -0.5, r"rollout.train.temperature=-0.5: expected >= 0"),
        ("top_p", 0.0, r"rollout.train.top_p=0.0: expected in \(0, 1\]"),
        ("top_k", -1, r"rollout.train.top_k=-1: expected >= 0 \(0 disables top-k\)"),
        ("max_new_tokens", 0, r"rollout.train.max_new_tokens=0: expected at least 1"),
    ],
)
def test_bad_sampling_is_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(train=SamplingConfig(**{field: value})).validate()


def test_only_stop_strings_make_the_engine_load_the_tokenizer(tiny_models):
    """Token ids need no tokenizer; stop strings do, in training's or evaluation's sampling. Without one the engine
    stops at the tokenizer's EOS by id, which the tiny models' character tokenizer and SmolLM2's both name."""
    assert not RolloutConfig(train=SamplingConfig(stop_token_ids=[7])).stop_strings
    assert RolloutConfig(eval=SamplingConfig(stop=["\n\n"])).stop_strings
    assert RolloutConfig(train=SamplingConfig(stop=["</answer>"])).stop_strings
    assert tokenizer_eos_ids(tiny_models["LlamaForCausalLM"]) == [2]  # <|im_end|>


def test_rollout_sizes_are_checked():
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=0"):
        RolloutConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match=r"rollout.sleep_level=3: expected 1 or 2"):
        RolloutConfig(sleep_level=3).validate()


def test_cpu_binding_splits_cores_over_tp_workers(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1, 2, 3})
    assert cpu_thread_binding(RolloutConfig(tensor_parallel_size=1)) == "0,1,2,3"
    assert cpu_thread_binding(RolloutConfig(tensor_parallel_size=2)) == "0,1|2,3"
    assert cpu_thread_binding(RolloutConfig(tensor_parallel_size=8)).count("|") == 7  # more workers than cores
    assert cpu_thread_binding(RolloutConfig(cpu_threads_bind="0-1|2-3")) == "0-1|2-3"


def test_sync_config_and_probe_batch():
    with pytest.raises(ValueError, match=r"sync.bucket_bytes=0: expected a positive number of bytes"):
        SyncConfig(bucket_bytes=0).validate()
    with pytest.raises(
        ValueError, match=r"sync.probe_length=1: expected sync.probe_sequences >= 1 and sync.probe_length >= 2"
    ):
        SyncConfig(probe_length=1).validate()
    config = SyncConfig(probe_sequences=3, probe_length=9)
    probe = probe_tokens(50, config)
    assert probe.shape == (3, 9) and int(probe.max()) < 50
    assert probe.equal(probe_tokens(50, config))  # fixed: the same batch at every sync


@pytest.mark.parametrize("rows,engines", [(4, 1), (4, 2), (4, 3), (5, 2), (4, 4), (2, 5)])
def test_the_engines_share_the_probe_rows_each_scoring_at_least_one(rows, engines):
    shares = [engine_probe_rows(rows, engines, i) for i in range(engines)]
    assert all(shares)  # every engine is checked
    scored = sorted(r for share in shares for r in share)
    if engines <= rows:  # each row once, the shares as even as they go
        assert scored == list(range(rows)) and max(map(len, shares)) - min(map(len, shares)) <= 1
    else:  # more engines than rows: one row each, every row scored
        assert all(len(share) == 1 for share in shares) and set(scored) == set(range(rows))
