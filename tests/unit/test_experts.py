"""The grouped experts' bias check reads layers as Megatron-Core does on both of its module backends."""

import torch

from models.experts import has_bias


def test_a_transformer_engine_style_empty_bias_is_no_bias():
    """Megatron's local linears without a bias keep ``None``; TransformerEngine's keep an empty tensor, which the
    grouped experts refused (every MoE model on the TE spec) when they tested ``bias is not None``."""
    local = torch.nn.Linear(4, 8, bias=False)
    te_style = torch.nn.Linear(4, 8, bias=False)
    te_style.bias = torch.nn.Parameter(torch.empty(0))
    biased = torch.nn.Linear(4, 8)
    assert [has_bias(m) for m in (local, te_style, biased)] == [False, False, True]
