import pytest
import torch

from converters import transforms


@pytest.mark.parametrize("rest", [(8,), ()])  # weights [rows, hidden] and biases [rows]
def test_qkv_merge_interleaves_per_group_and_inverts(rest):
    heads, groups, d = 4, 2, 3
    q = torch.arange(heads * d).float().reshape(heads * d, *([1] * len(rest))).expand(-1, *rest).contiguous()
    k = 100 + torch.arange(groups * d).float().reshape(groups * d, *([1] * len(rest))).expand(-1, *rest).contiguous()
    v = 200 + k
    merged = transforms.merge_qkv(q, k, v, groups)
    rows = merged.reshape(merged.shape[0], -1)[:, 0].tolist()
    # group 0: q heads 0,1 then k0 then v0; group 1: q heads 2,3, k1, v1
    assert rows[: 2 * d] == list(range(2 * d)) and rows[2 * d : 3 * d] == [100, 101, 102]
    assert rows[3 * d : 4 * d] == [300, 301, 302] and rows[4 * d : 6 * d] == list(range(2 * d, 4 * d))
    for got, want in zip(transforms.split_qkv(merged, heads, groups, d), (q, k, v), strict=True):
        assert torch.equal(got, want)


def test_gated_merge_puts_gate_and_up_chunks_on_each_tp_rank():
    gate, up = torch.arange(8.0).reshape(8, 1), 10 + torch.arange(8.0).reshape(8, 1)
    merged = transforms.merge_gated(gate, up, tp=2)
    shard0 = transforms.shard(merged, 0, 0, 2)
    assert shard0.flatten().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    g, u = transforms.split_gated(merged, tp=2)
    assert torch.equal(g, gate) and torch.equal(u, up)
    # one shard: its halves, as views
    g, u = transforms.split_gated(transforms.merge_gated(gate, up, tp=1), tp=1)
    assert torch.equal(g, gate) and torch.equal(u, up) and g._base is not None and u._base is g._base


def test_pad_vocab_and_errors():
    w = torch.ones(5, 2)
    padded = transforms.pad_vocab(w, 8)
    assert padded.shape == (8, 2) and padded[5:].abs().sum() == 0
    with pytest.raises(ValueError, match="does not fit"):
        transforms.pad_vocab(w, 4)
    with pytest.raises(ValueError, match="not divisible by the TP size 2"):
        transforms.shard(torch.ones(3, 2), 0, 0, 2)


def test_rope_rows_permute_per_block_and_invert():
    period, offset, rope = 6, 2, 4  # per head: 2 non-rotary rows, then 4 rotary rows
    weight = torch.arange(2 * period).float()[:, None].expand(-1, 3)
    half = transforms.permute_rope_rows(weight, period, offset, rope)
    assert half[:, 0].tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]  # (r0 r1 r2 r3) -> (r0 r2 r1 r3)
    assert torch.equal(transforms.permute_rope_rows(half, period, offset, rope, inverse=True), weight)
