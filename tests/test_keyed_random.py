import math

import torch

from dit_lightning.keyed_random import keyed_normal, keyed_randint, keyed_uniform, sample_keys, splitmix64


def test_splitmix64_known_value():
    # splitmix64 of state 0 (first output of the generator seeded with 0) is 0xE220A8397B1DCDAF.
    assert splitmix64(torch.tensor([0])).item() == 0xE220A8397B1DCDAF - (1 << 64)


def test_draws_depend_only_on_the_keys_not_on_the_batch_layout():
    index = torch.arange(16)
    whole = keyed_normal(sample_keys(index, 7, 3), (2, 4, 4))
    halves = torch.cat(
        [keyed_normal(sample_keys(index[:8], 7, 3), (2, 4, 4)), keyed_normal(sample_keys(index[8:], 7, 3), (2, 4, 4))]
    )
    assert torch.equal(whole, halves)
    shuffled = torch.randperm(16)
    assert torch.equal(keyed_normal(sample_keys(index[shuffled], 7, 3), (2, 4, 4)), whole[shuffled])
    assert not torch.equal(keyed_normal(sample_keys(index, 7, 4), (2, 4, 4)), whole)  # another step
    assert not torch.equal(keyed_normal(sample_keys(index, 8, 3), (2, 4, 4)), whole)  # another seed


def test_distributions():
    keys = sample_keys(torch.arange(4000), 1, 2)
    z = keyed_normal(keys, (64,))
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01
    assert abs((z.abs() < 1).float().mean().item() - math.erf(1 / math.sqrt(2))) < 0.01
    u = keyed_uniform(keys, (16,))
    assert 0 < u.min().item() and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01
    t = keyed_randint(keys, 1000)
    assert t.min().item() >= 0 and t.max().item() <= 999 and len(t.unique()) > 900
    # different streams are independent draws
    a, b = keyed_uniform(keys, (), stream=1), keyed_uniform(keys, (), stream=2)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.05
