import pytest

from parallel.config import ParallelConfig

MODEL = dict(num_layers=4, num_attention_heads=4, num_query_groups=2, vocab_size=100)


def test_dp_is_derived():
    assert ParallelConfig(tp=2, pp=2).dp(8) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tp=0), r"parallel.tp=0: expected a positive integer"),
        (dict(vpp=2), r"parallel.vpp=2 needs parallel.pp > 1"),
        (dict(sequence_parallel=True), r"sequence_parallel=True needs parallel.tp > 1"),
    ],
)
def test_invalid_fields_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_world_size_must_fit_layout():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp\*pp\*cp = 2\*2\*1 = 4"):
        ParallelConfig(tp=2, pp=2).validate_world(6)
    with pytest.raises(ValueError, match=r"etp\*ep\*pp"):
        ParallelConfig(ep=4).validate_world(2)


@pytest.mark.parametrize(
    ("layout", "model", "match"),
    [
        (dict(pp=3), {}, r"num_layers=4 is not divisible by pp\*vpp = 3\*1"),
        # The TP sizes offered split both head counts (4 query heads, 2 KV heads: not 4).
        (dict(tp=3), {}, r"num_attention_heads=4 is not divisible by tp=3; choose tp among \[1, 2\]$"),
        (dict(tp=4), {}, r"num_key_value_heads=2 is not divisible by tp=4; choose tp among \[1, 2\]$"),
        (dict(ep=3), dict(num_experts=4), r"num_experts=4 is not divisible by ep=3"),
        (dict(ep=2), {}, r"ep=2 but the model has no experts"),
        (dict(tp=2), dict(num_experts=4), r"need parallel.sequence_parallel=True"),
    ],
)
def test_model_must_split_over_layout(layout, model, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**layout).validate_model(**{**MODEL, **model})


def test_uneven_pipeline_stages():
    """DeepSeek-V3's 61 layers over PP=8: 5 on the last stage, 8 on each other."""
    assert ParallelConfig(pp=8, last_stage_layers=5).stage_layers(61) == [8] * 7 + [5]
    assert ParallelConfig(pp=4, first_stage_layers=1, last_stage_layers=1).stage_layers(10) == [1, 4, 4, 1]
    assert ParallelConfig(pp=2, vpp=2).stage_layers(8) == [4, 4]
    with pytest.raises(ValueError, match=r"leave 56 layers for the other 6 stage\(s\), which must split them evenly"):
        ParallelConfig(pp=8, first_stage_layers=2, last_stage_layers=3).stage_layers(61)
    with pytest.raises(ValueError, match=r"num_layers=61 is not divisible by pp\*vpp = 8\*1 = 8; .*last_stage_layers"):
        ParallelConfig(pp=8).stage_layers(61)
    with pytest.raises(ValueError, match=r"parallel.last_stage_layers needs pp > 1 and vpp = 1"):
        ParallelConfig(pp=2, vpp=2, last_stage_layers=1)
    with pytest.raises(ValueError, match=r"parallel.first_stage_layers=0: expected a positive integer"):
        ParallelConfig(pp=2, first_stage_layers=0)
