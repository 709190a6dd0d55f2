"""Structured pruning of a DiT (depth, MLP channels, attention heads): shapes, parameter counts,
exactness where nothing is removed, and block importance."""

import pytest
import torch

from dit_lightning.diffusion import create_diffusion
from dit_lightning.models import DiTShape, dit_params, mlp_ratio_for
from dit_lightning.models.pruning import block_importance, prune_depth, prune_heads, prune_mlp, select_blocks
from tests.helpers.models import inputs, randomized

pytestmark = pytest.mark.usefixtures("one_thread")


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_keeping_everything_is_the_identity():
    model = randomized()
    x, t, y = inputs()
    ref = model(x, t, y)
    for pruned in (prune_depth(model, [0, 1, 2]), prune_mlp(model, keep_ratio=1.0), prune_heads(model, 4)):
        assert torch.equal(pruned(x, t, y), ref)
        assert n_params(pruned) == n_params(model) == dit_params(DiTShape.of(pruned))


def test_pruned_shapes_and_parameter_counts():
    model = randomized()
    shallow = prune_depth(model, 2, scores=torch.tensor([0.3, -0.1, 0.2]))
    assert len(shallow.blocks) == shallow.depth == 2
    assert n_params(shallow) == dit_params(DiTShape(**{**vars(DiTShape.of(model)), "depth": 2}))

    narrow = prune_mlp(model, keep_channels=50)
    assert narrow.blocks[1].mlp.fc1.weight.shape == (50, 32) and narrow.blocks[1].mlp.fc2.weight.shape == (32, 50)
    assert int(narrow.hidden_size * narrow.mlp_ratio) == 50
    assert n_params(narrow) == dit_params(DiTShape.of(narrow)) < n_params(model)
    assert not any(n.endswith("mask") for n, _ in narrow.named_buffers())

    few_heads = prune_heads(model, 2)  # head_dim 8 stays: attention width 16, residual 32
    attn = few_heads.blocks[0].attn
    assert (attn.num_heads, attn.head_dim) == (2, 8)
    assert attn.qkv.weight.shape == (48, 32) and attn.proj.weight.shape == (32, 16)
    removed_per_block = 3 * 16 * (32 + 1) + 32 * 16  # qkv rows (weights + bias), proj columns
    assert n_params(few_heads) == n_params(model) - 3 * removed_per_block
    assert few_heads(*inputs()).shape == (4, 8, 8, 8)


def test_depth_pruning_equals_running_the_kept_blocks_only():
    model = randomized()
    x, t, y = inputs()
    handle = model.blocks[1].register_forward_hook(lambda _m, args, _out: args[0])
    try:
        expected = model(x, t, y)
    finally:
        handle.remove()
    pruned = prune_depth(model, [0, 2])
    assert torch.equal(pruned(x, t, y), expected)
    assert not torch.allclose(model(x, t, y), expected)


def test_channels_and_heads_without_output_weights_are_pruned_first_and_change_nothing():
    model = randomized()
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.fc2.weight[:, 7:47] = 0  # 40 of 128 channels reach nothing
            block.attn.proj.weight[:, 8:16] = 0  # head 1 reaches nothing
    x, t, y = inputs()
    ref = model(x, t, y)
    narrow = prune_mlp(model, keep_channels=88)
    assert narrow.blocks[0].mlp.fc1.weight.shape[0] == 88
    torch.testing.assert_close(narrow(x, t, y), ref, rtol=1e-5, atol=1e-5)
    few_heads = prune_heads(model, 3)
    torch.testing.assert_close(few_heads(x, t, y), ref, rtol=1e-5, atol=1e-5)


def test_block_importance_scores_an_identity_block_zero_and_selection_drops_the_weakest():
    model = randomized()
    with torch.no_grad():
        model.blocks[1].adaLN_modulation[-1].weight.zero_()
        model.blocks[1].adaLN_modulation[-1].bias.zero_()  # gates 0: the block is the identity
    batch = {"x": torch.randn(6, 4, 8, 8), "y": torch.randint(0, 10, (6,))}
    scores = block_importance(model, create_diffusion(""), batch, draws=2)
    assert scores.shape == (3,) and scores[1] == 0
    assert select_blocks(3, 2, torch.tensor([0.5, 0.0, 0.2])) == [0, 2]
    assert select_blocks(6, 3) == [0, 2, 5]  # evenly spaced without scores
    with pytest.raises(ValueError, match="distinct"):
        select_blocks(3, [0, 0])


def test_mlp_ratio_recovers_the_channel_count_exactly():
    assert int(56 * (61 / 56)) == 60  # the plain ratio loses a channel
    assert int(56 * mlp_ratio_for(56, 61)) == 61
    model = randomized(hidden_size=56, num_heads=4)
    pruned = prune_depth(prune_mlp(model, keep_channels=61), 2)  # the rebuild keeps 61 channels
    assert pruned.blocks[0].mlp.fc1.out_features == 61


def test_lightningdit_block_prunes_swiglu_channels_heads_and_depth_exactly():
    """SwiGLU: a channel is a gate row and a value row of w12 and a column of w3, removed together;
    heads keep their size (rope's tables and RMSNorm QK-norm stay valid); depth is plain."""
    model = randomized(norm="rmsnorm", mlp="swiglu", pos_embed="rope", qk_norm=True, num_heads=2)
    hidden = model.blocks[0].mlp.hidden_dim  # int(2/3 * 128) = 85
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.w3.weight[:, 5:30] = 0  # 25 channels reach nothing
            block.mlp.w12.weight[hidden + 40 : hidden + 45] = 0  # 5 more: their value rows are zero
            block.mlp.w12.bias[hidden + 40 : hidden + 45] = 0
            block.attn.proj.weight[:, 16:32] = 0  # head 1 reaches nothing
    x, t, y = inputs()
    ref = model(x, t, y)
    narrow = prune_mlp(model, keep_channels=hidden - 30)
    assert narrow.blocks[0].mlp.w12.weight.shape[0] == 2 * (hidden - 30)
    assert narrow.blocks[0].mlp.hidden_dim == hidden - 30 and narrow.mlp_kind == "swiglu"
    torch.testing.assert_close(narrow(x, t, y), ref, rtol=1e-5, atol=1e-5)
    one_head = prune_heads(model, 1)
    assert one_head.blocks[0].attn.head_dim == 16 and one_head.feat_rope is not None
    torch.testing.assert_close(one_head(x, t, y), ref, rtol=1e-5, atol=1e-5)
    shallow = prune_depth(narrow, [0, 2])
    assert len(shallow.blocks) == 2 and shallow.blocks[0].mlp.hidden_dim == hidden - 30
