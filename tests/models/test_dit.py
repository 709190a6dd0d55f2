import math

import pytest
import torch

from dit_lightning.models import DIT_CONFIGS, DiT, build_dit, dit_macs, dit_params, resolve_checkpoint_blocks, shape_of
from tests.helpers.models import randomize, tiny_dit_kwargs
from tests.helpers.reference_forward import reference_forward

# REFERENCE.md section 1: parameters including pos_embed, 256px (32x32 latents), 1000 classes.
PUBLISHED_PARAMS = {
    "DiT-S/8": 33_148_160,
    "DiT-S/4": 32_945_024,
    "DiT-S/2": 32_963_360,
    "DiT-B/2": 130_512_416,
    "DiT-L/2": 458_102_816,
    "DiT-XL/8": 675_683_072,
    "DiT-XL/4": 675_074_432,
    "DiT-XL/2": 675_129_632,
}
PUBLISHED_GMACS = {
    "DiT-S/8": 0.36,
    "DiT-S/4": 1.41,
    "DiT-S/2": 6.06,
    "DiT-B/4": 5.56,
    "DiT-B/2": 23.01,
    "DiT-L/4": 19.70,
    "DiT-L/2": 80.71,
    "DiT-XL/8": 7.39,
    "DiT-XL/4": 29.05,
    "DiT-XL/2": 118.64,
}


def test_registry_has_all_twelve_configurations():
    assert len(DIT_CONFIGS) == 12
    assert DIT_CONFIGS["DiT-XL/2"] == {"depth": 28, "hidden_size": 1152, "num_heads": 16, "patch_size": 2}
    assert build_dit("DiT-S-8", input_size=8, num_classes=3).patch_size == 8  # file-name spelling


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_the_paper(name):
    with torch.device("meta"):
        model = build_dit(name)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]
    assert dit_params(shape_of(name)) == PUBLISHED_PARAMS[name]


def test_parameter_count_at_512px():
    with torch.device("meta"):
        model = build_dit("DiT-XL/2", input_size=64)
    assert sum(p.numel() for p in model.parameters()) == 676_014_368


@pytest.mark.parametrize("name", sorted(PUBLISHED_GMACS))
def test_analytic_gmacs_match_the_published_table(name):
    # The table is rounded to 0.01 GMACs; beyond that rounding we agree to 0.1%.
    gmacs = dit_macs(shape_of(name)) / 1e9
    assert abs(gmacs - PUBLISHED_GMACS[name]) <= 0.005 + 1e-3 * PUBLISHED_GMACS[name]


def test_gmacs_at_512px():
    assert dit_macs(shape_of("DiT-XL/2", input_size=64)) / 1e9 == pytest.approx(524.6, rel=1e-3)


def test_state_dict_keys_match_the_released_checkpoints():
    with torch.device("meta"):
        model = build_dit("DiT-S/2")
    keys = set(model.state_dict())
    assert len(keys) == 132
    expected = {
        "pos_embed",
        "x_embedder.proj.weight",
        "x_embedder.proj.bias",
        "t_embedder.mlp.0.weight",
        "t_embedder.mlp.0.bias",
        "t_embedder.mlp.2.weight",
        "t_embedder.mlp.2.bias",
        "y_embedder.embedding_table.weight",
        "final_layer.linear.weight",
        "final_layer.linear.bias",
        "final_layer.adaLN_modulation.1.weight",
        "final_layer.adaLN_modulation.1.bias",
    }
    for i in range(12):
        for part in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1"):
            expected |= {f"blocks.{i}.{part}.weight", f"blocks.{i}.{part}.bias"}
    assert keys == expected
    sd = model.state_dict()
    assert tuple(sd["y_embedder.embedding_table.weight"].shape) == (1001, 384)
    assert tuple(sd["blocks.0.adaLN_modulation.1.weight"].shape) == (6 * 384, 384)
    assert tuple(sd["final_layer.linear.weight"].shape) == (2 * 2 * 8, 384)
    assert not model.pos_embed.requires_grad


def test_fresh_model_outputs_exactly_zero():
    model = DiT(**tiny_dit_kwargs())
    x = torch.randn(3, 4, 8, 8)
    out = model(x, torch.tensor([0, 500, 999]), torch.tensor([1, 2, 3]))
    assert out.shape == (3, 8, 8, 8)
    assert torch.count_nonzero(out) == 0


def test_initialisation_rules():
    model = DiT(**tiny_dit_kwargs(hidden_size=64, depth=3))
    assert model.y_embedder.embedding_table.weight.std().item() == pytest.approx(0.02, rel=0.15)
    assert model.t_embedder.mlp[0].weight.std().item() == pytest.approx(0.02, rel=0.15)
    qkv = model.blocks[0].attn.qkv.weight
    bound = math.sqrt(6 / (qkv.shape[0] + qkv.shape[1]))  # xavier_uniform
    assert qkv.abs().max().item() <= bound and qkv.abs().max().item() > 0.9 * bound
    assert torch.count_nonzero(model.blocks[0].attn.qkv.bias) == 0
    w = model.x_embedder.proj.weight
    bound = math.sqrt(6 / (w.shape[0] + w[0].numel()))
    assert w.abs().max().item() <= bound and w.abs().max().item() > 0.9 * bound
    for block in model.blocks:
        assert torch.count_nonzero(block.adaLN_modulation[-1].weight) == 0


def test_positional_embedding_closed_form():
    d, g = 16, 4
    model = DiT(**tiny_dit_kwargs(hidden_size=d, num_heads=2, input_size=2 * g))
    pe = model.pos_embed[0]
    omega = 1.0 / 10000 ** (torch.arange(d // 4, dtype=torch.float64) / (d // 4))
    for i in range(g):  # row (h)
        for j in range(g):  # column (w): the reference puts w in the first half
            expect = torch.cat(
                [torch.sin(j * omega), torch.cos(j * omega), torch.sin(i * omega), torch.cos(i * omega)]
            ).float()
            torch.testing.assert_close(pe[i * g + j], expect, rtol=0, atol=1e-6)


def test_forward_equals_an_independent_plain_implementation():
    kw = tiny_dit_kwargs(hidden_size=48, num_heads=3, depth=3)
    model = randomize(DiT(**kw)).eval()
    x = torch.randn(2, 4, 8, 8)
    t = torch.tensor([3, 871])
    y = torch.tensor([7, 10])  # 10 is the null class
    expect = reference_forward(model.state_dict(), x, t, y, patch=2, heads=3, depth=3, out_channels=8)
    torch.testing.assert_close(model(x, t, y), expect, rtol=1e-4, atol=1e-4)


def test_label_dropout_uses_the_null_class():
    model = DiT(**tiny_dit_kwargs()).train()
    y = torch.arange(10)
    dropped = model.y_embedder.token_drop(y, torch.tensor([1, 0] * 5))
    assert dropped.tolist() == [10, 1, 10, 3, 10, 5, 10, 7, 10, 9]
    torch.manual_seed(0)
    drops = (model.y_embedder.token_drop(torch.zeros(20000, dtype=torch.long)) == 10).float().mean()
    assert drops.item() == pytest.approx(0.1, abs=0.01)
    no_cfg = DiT(**tiny_dit_kwargs(class_dropout_prob=0.0))
    assert no_cfg.y_embedder.embedding_table.num_embeddings == 10


def test_cfg_scale_one_equals_the_conditional_output():
    model = randomize(DiT(**tiny_dit_kwargs())).eval()
    z = torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 10, 10, 10])
    y = torch.tensor([1, 2, 10, 10])
    out = model.forward_with_cfg(torch.cat([z, z]), t, y, cfg_scale=1.0)
    cond = model(z, t[:2], y[:2])
    torch.testing.assert_close(out[:2, :4], cond[:, :4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:2, 4:], cond[:, 4:], rtol=1e-5, atol=1e-5)


def test_cfg_guides_all_channels_by_default_and_three_in_reference_mode():
    model = randomize(DiT(**tiny_dit_kwargs())).eval()
    z = torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 10, 10, 10])
    y = torch.tensor([1, 2, 10, 10])
    cond, uncond = model(z, t[:2], y[:2]), model(z, t[2:], y[2:])
    guided = uncond + 4.0 * (cond - uncond)
    full = model.forward_with_cfg(torch.cat([z, z]), t, y, cfg_scale=4.0)
    torch.testing.assert_close(full[:2, :4], guided[:, :4], rtol=1e-4, atol=1e-4)
    ref = model.forward_with_cfg(torch.cat([z, z]), t, y, cfg_scale=4.0, guide_channels=3)
    torch.testing.assert_close(ref[:2, :3], guided[:, :3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref[:2, 3], cond[:, 3], rtol=1e-5, atol=1e-5)  # the reference's quirk


def test_checkpoint_spec_resolution():
    assert resolve_checkpoint_blocks(None, 6) == ()
    assert resolve_checkpoint_blocks("none", 6) == ()
    assert resolve_checkpoint_blocks("all", 6) == (0, 1, 2, 3, 4, 5)
    assert resolve_checkpoint_blocks("half", 6) == (0, 1, 2)
    assert resolve_checkpoint_blocks("first:4", 6) == (0, 1, 2, 3)
    assert resolve_checkpoint_blocks(2, 6) == (0, 1)
    assert resolve_checkpoint_blocks("every:2", 6) == (0, 2, 4)
    assert resolve_checkpoint_blocks([5, 1, 1], 6) == (1, 5)
    with pytest.raises(ValueError, match="out of range"):
        resolve_checkpoint_blocks([6], 6)
    with pytest.raises(ValueError, match="not understood"):
        resolve_checkpoint_blocks("sometimes", 6)


@pytest.mark.parametrize("spec", ["all", "every:2", [1]])
def test_activation_checkpointing_gives_identical_gradients(spec):
    kw = tiny_dit_kwargs(depth=3)
    plain = randomize(DiT(**kw)).train()
    ckpt = DiT(**kw, activation_checkpointing=spec).train()
    ckpt.load_state_dict(plain.state_dict())
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([5, 50]), torch.tensor([1, 2])
    drop = torch.tensor([False, True])
    for m in (plain, ckpt):
        m(x, t, y, force_drop_ids=drop).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert ckpt.checkpoint_blocks and plain.checkpoint_blocks == ()


def test_bad_sizes_get_clear_errors():
    with pytest.raises(ValueError, match="does not divide the latent size"):
        DiT(**tiny_dit_kwargs(input_size=10, patch_size=4))
    with pytest.raises(ValueError, match="unknown DiT model 'DiT-M/2'"):
        build_dit("DiT-M/2")
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        DiT(**tiny_dit_kwargs(hidden_size=30, num_heads=4))


def test_raw_state_dict_round_trip_strict():
    a = randomize(DiT(**tiny_dit_kwargs()))
    b = DiT(**tiny_dit_kwargs())
    b.load_state_dict(a.state_dict(), strict=True)
    x, t, y = torch.randn(1, 4, 8, 8), torch.tensor([1]), torch.tensor([1])
    torch.testing.assert_close(a.eval()(x, t, y), b.eval()(x, t, y))


def test_torch_compile_matches_eager():
    model = randomize(DiT(**tiny_dit_kwargs(depth=1))).eval()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 4]), torch.tensor([1, 2])
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, t, y), model(x, t, y), rtol=1e-4, atol=1e-4)
