"""Offload frees the storages behind parameters, gradients and optimizer state; onload restores them in place."""

import torch

from mcore_rl.trainer.offload import StorageOffloader


def test_offload_frees_and_restores_shared_storages_exactly():
    flat = torch.randn(64)
    params = [flat[:40].view(4, 10), flat[40:]]  # views of one buffer, like Megatron's DDP param buffer
    grads = torch.randn(64)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    before = [t.clone() for t in [flat, *state]]
    expected = flat.nbytes + grads.nbytes + sum(t.untyped_storage().nbytes() for t in state)
    offloader = StorageOffloader(params + state + [params[0]], [grads, flat[:8]])  # duplicates count once
    freed = offloader.offload()
    assert freed == expected
    assert flat.untyped_storage().nbytes() == grads.untyped_storage().nbytes() == 0
    assert offloader.offload() == 0  # idempotent
    assert offloader.onload() == freed
    assert params[0].data_ptr() == flat.data_ptr()  # the views still point into the restored buffer
    assert all(torch.equal(a, b) for a, b in zip([flat, *state], before, strict=True))
    assert grads.untyped_storage().nbytes() == grads.nbytes  # re-allocated (contents are zeroed before a step)
