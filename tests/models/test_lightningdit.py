"""LightningDiT's block as options of the project's DiT, against LightningDiT's own code
(tests/helpers/lightningdit_reference.py): its state dicts load strictly and give its outputs."""

from typing import Any

import pytest
import torch

from dit_lightning.checkpoints import load_dit
from dit_lightning.checkpoints.architecture import check_dit_weights, infer_dit_config
from dit_lightning.models import DiT, build_dit, build_from_config, model_config
from dit_lightning.models.dit import LIGHTNINGDIT_CONFIGS, RotaryEmbedding2D, dit_config
from tests.helpers.models import randomize

reference = pytest.importorskip("tests.helpers.lightningdit_reference")  # timm: the test extra installs it

# (their flags, our options): each option alone, LightningDiT's published block, and with QK-norm / wo_shift.
CASES = {
    "rmsnorm": ({"use_rmsnorm": True}, {"norm": "rmsnorm"}),
    "swiglu": ({"use_swiglu": True}, {"mlp": "swiglu"}),
    "rope": ({"use_rope": True}, {"pos_embed": "rope"}),
    "wo_shift": ({"wo_shift": True}, {"wo_shift": True}),
    "published": (
        {"use_rmsnorm": True, "use_swiglu": True, "use_rope": True},
        {"norm": "rmsnorm", "mlp": "swiglu", "pos_embed": "rope"},
    ),
    "rms-qknorm": (
        {"use_rmsnorm": True, "use_qknorm": True, "use_rope": True},
        {"norm": "rmsnorm", "qk_norm": True, "pos_embed": "rope"},
    ),
    "none": ({}, {}),
}
SIZE: dict[str, Any] = {
    "input_size": 8,
    "in_channels": 4,
    "hidden_size": 32,
    "depth": 2,
    "num_heads": 2,
    "num_classes": 10,
}


def _pair(theirs: dict, ours: dict, patch: int, learn_sigma: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    official = reference.LightningDiT(patch_size=patch, learn_sigma=learn_sigma, **SIZE, **theirs)
    randomize(official)  # a fresh one outputs exactly 0 (adaLN-Zero)
    net = DiT(patch_size=patch, learn_sigma=learn_sigma, **SIZE, **ours)
    net.load_state_dict(official.state_dict(), strict=True)
    return official.eval(), net.eval()


def _inputs(n: int = 4):
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(n, 4, 8, 8, generator=g),
        torch.tensor([0.0, 0.3, 0.7, 1.0])[:n] * 999,
        torch.tensor([1, 2, 10, 7])[:n],
    )


@pytest.mark.parametrize("patch", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_official_lightningdit_loads_strictly_and_gives_its_outputs(case, patch):
    official, net = _pair(*CASES[case], patch=patch)
    x, t, y = _inputs()
    with torch.no_grad():
        expected = official(x, t, y)
        assert expected.abs().mean() > 0.1  # the comparison is of real outputs
        torch.testing.assert_close(net(x, t, y), expected, rtol=0, atol=1e-5)
        z = torch.cat([x[:2], x[:2]])
        labels = torch.tensor([1, 2, 10, 10])
        torch.testing.assert_close(
            net.forward_with_cfg(z, t, labels, 4.0, guide_channels=3),
            official.forward_with_cfg(z, t, labels, 4.0),
            rtol=0,
            atol=1e-5,
        )


def test_learn_sigma_lightningdit_keeps_the_first_half_of_our_channels():
    """LightningDiT's forward drops the variance half of a learn_sigma network; ours returns both."""
    official, net = _pair(*CASES["published"], patch=2, learn_sigma=True)
    x, t, y = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(net(x, t, y)[:, :4], official(x, t, y), rtol=0, atol=1e-5)


def test_rope_tables_are_lightningdits_and_rope_keeps_the_sincos_embedding():
    ours = RotaryEmbedding2D(head_dim=16, grid_size=7)  # 7: arange(7) / 7 * 7 is not all integers
    theirs = reference.VisionRotaryEmbeddingFast(dim=8, pt_seq_len=7)
    assert torch.equal(ours.freqs_cos, theirs.freqs_cos) and torch.equal(ours.freqs_sin, theirs.freqs_sin)
    net = DiT(patch_size=1, **SIZE, pos_embed="rope")
    plain = DiT(patch_size=1, **SIZE)
    assert torch.equal(net.pos_embed, plain.pos_embed)  # LightningDiT adds rope to the absolute embedding
    with pytest.raises(ValueError, match="divisible by 4"):
        DiT(patch_size=1, **{**SIZE, "num_heads": 16}, pos_embed="rope")  # head size 2


def test_initialisation_draws_like_lightningdits():
    """Same seed, same weights: the options build their layers in LightningDiT's order."""
    theirs, ours = CASES["published"]
    torch.manual_seed(5)
    official = reference.LightningDiT(patch_size=1, **SIZE, **theirs)
    torch.manual_seed(5)
    net = DiT(patch_size=1, learn_sigma=False, **SIZE, **ours)
    expected = official.state_dict()
    assert set(net.state_dict()) == set(expected)  # the order of norm2 differs, which draws nothing
    assert all(torch.equal(v, expected[k]) for k, v in net.state_dict().items())


def test_default_block_is_unchanged():
    """DiT's block stays the default: no new weight or buffer, and the explicit defaults are the same network."""
    kw = dict(patch_size=2, **SIZE)
    torch.manual_seed(0)
    default = DiT(**kw)
    torch.manual_seed(0)
    explicit = DiT(**kw, norm="layernorm", mlp="gelu", pos_embed="sincos", wo_shift=False)
    assert not any(k.startswith("feat_rope") or ".w12" in k or "norm1.weight" in k for k in default.state_dict())
    assert all(torch.equal(v, explicit.state_dict()[k]) for k, v in default.state_dict().items())
    assert set(model_config(default)) == set(model_config(explicit)) and "norm" not in model_config(default)


def test_registry_names_lightningdits_configurations(monkeypatch):
    for name in ("LightningDiT-B/1", "LightningDiT-XL/2"):  # built (on meta): the same tensors
        with torch.device("meta"):
            official = reference.LightningDiT_models[name](
                input_size=16, use_rmsnorm=True, use_swiglu=True, use_rope=True
            )
            net = build_dit(name, input_size=16, in_channels=32, learn_sigma=False)
        assert {k: tuple(v.shape) for k, v in net.state_dict().items()} == {
            k: tuple(v.shape) for k, v in official.state_dict().items()
        }, name
    # every name: the sizes LightningDiT's factory passes
    monkeypatch.setattr(reference, "LightningDiT", lambda **kw: kw)
    for name, factory in reference.LightningDiT_models.items():
        sizes = {k: v for k, v in dit_config(name).items() if k not in ("norm", "mlp", "pos_embed")}
        assert factory() == sizes, name
        assert {k: dit_config(name)[k] for k in ("norm", "mlp", "pos_embed")} == {
            "norm": "rmsnorm",
            "mlp": "swiglu",
            "pos_embed": "rope",
        }
    assert set(LIGHTNINGDIT_CONFIGS) == set(reference.LightningDiT_models)
    assert dit_config("LightningDiT-XL-1") == dit_config("LightningDiT-XL/1")


@pytest.mark.parametrize("case", ["published", "wo_shift", "rms-qknorm", "swiglu"])
def test_architecture_is_inferred_from_a_lightningdit_state_dict(case, tmp_path):
    """A raw LightningDiT training checkpoint ({"model", "ema", "opt", "config"}) is read with no flag."""
    official, net = _pair(*CASES[case], patch=1)
    cfg = infer_dit_config(official.state_dict())
    assert {k: cfg.get(k) for k in ("norm", "mlp", "pos_embed", "wo_shift")} == {
        "norm": CASES[case][1].get("norm"),
        "mlp": CASES[case][1].get("mlp"),
        "pos_embed": CASES[case][1].get("pos_embed"),
        "wo_shift": CASES[case][1].get("wo_shift"),
    }
    rope = "pos_embed" in cfg
    assert cfg["num_heads"] == 2 or not rope  # rope's tables give the head size; else hidden / 64 is guessed
    path = tmp_path / "0080000.pt"
    torch.save({"model": official.state_dict(), "ema": official.state_dict(), "opt": {}, "config": {}}, path)
    loaded = load_dit(str(path), num_heads=None if rope else 2)
    x, t, y = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded.net(x, t, y), official(x, t, y), rtol=0, atol=1e-5)
    assert model_config(loaded.net) == model_config(net)
    rebuilt = build_from_config(model_config(net))
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in net.state_dict().items()}


def test_another_block_is_refused_naming_the_options():
    official, _ = _pair(*CASES["published"], patch=1)
    with pytest.raises(ValueError, match="norm=rmsnorm, mlp=swiglu, pos_embed=rope.*missing"):
        check_dit_weights(DiT(patch_size=1, **SIZE), official.state_dict())
    with pytest.raises(ValueError, match="mlp='swish' is not a block option: choose one of gelu, swiglu"):
        DiT(patch_size=1, **SIZE, mlp="swish")


def test_the_options_survive_a_run_its_exports_and_sampling(tmp_path):
    """A LightningDiT-block run: hparams record the options, and the reference, raw (sidecar) and
    safetensors exports rebuild the same network (options read back, outputs equal); diffusers refuses."""
    from torch.utils.data import DataLoader

    from dit_lightning.checkpoints import export_checkpoint
    from dit_lightning.module import DiTModule
    from tests.helpers.training import TINY_MODULE, DictDataset, trainer

    options = dict(norm="rmsnorm", mlp="swiglu", pos_embed="rope", qk_norm=True)
    module = DiTModule(**TINY_MODULE, **options, ema_decay=0.5)
    assert {k: module.hparams[k] for k in options} == options
    t = trainer(max_steps=1, default_root_dir=tmp_path)
    t.fit(module, DataLoader(DictDataset(), batch_size=8))
    ckpt = tmp_path / "run.ckpt"
    t.save_checkpoint(ckpt)
    x, steps, y = torch.randn(2, 1, 8, 8), torch.tensor([3, 700]), torch.tensor([1, 10])
    assert module.ema is not None
    with torch.no_grad():
        expected = module.ema.eval()(x, steps, y)
    for fmt, name in (("reference", "ref.pt"), ("raw", "raw.pt"), ("safetensors", "w.safetensors")):
        export_checkpoint(str(ckpt), str(tmp_path / name), format=fmt)
        loaded = load_dit(str(tmp_path / name))
        assert {k: loaded.config.get(k) for k in options} == options, fmt
        ema = module.ema.state_dict()
        assert all(torch.equal(v, ema[k]) for k, v in loaded.net.state_dict().items()), fmt  # rope's tables too
        with torch.no_grad():  # (equal weights in other buffers may round differently in the last bit)
            torch.testing.assert_close(loaded.net(x, steps, y), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="RMSNorm.*SwiGLU.*rotary"):
        export_checkpoint(str(ckpt), str(tmp_path / "pipe"), format="diffusers")


def test_levers_run_the_lightningdit_block():
    """Activation checkpointing (same gradients), REPA's hidden_at, and compiled blocks (same outputs)."""
    kw = dict(patch_size=2, **SIZE, norm="rmsnorm", mlp="swiglu", pos_embed="rope")
    torch.manual_seed(0)
    plain = randomize(DiT(**kw))
    again = DiT(**kw, activation_checkpointing="all")
    again.load_state_dict(plain.state_dict())
    x, t, y = _inputs()
    grads = []
    for net in (plain, again):
        net.train()
        out, hidden = net(x, t, y, force_drop_ids=torch.zeros(4), hidden_at=1)
        (out.square().mean() + hidden.mean()).backward()
        grads.append([p.grad for p in net.parameters() if p.requires_grad])
    assert hidden.shape == (4, 16, 32)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    plain.eval()
    with torch.no_grad():
        expected = plain(x, t, y)
        # what --model.compile blocks does, traced whole (no graph break on the rope tables); the
        # eager backend: inductor's code generation is tested on DiT's block in test_dit.py
        plain.blocks[0].compile(backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(plain(x, t, y), expected, rtol=1e-5, atol=1e-5)
