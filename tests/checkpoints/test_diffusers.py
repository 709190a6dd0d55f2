"""diffusers' DiT layout and safetensors, both ways: the one name rule, exports that diffusers'
own ``DiTTransformer2DModel`` / ``DiTPipeline`` load offline and that compute the DiT, bit-identical
round trips, and the architectures diffusers cannot express."""

import json
import os

import pytest
import torch
from diffusers import DiTPipeline, DiTTransformer2DModel
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from dit_lightning.checkpoints import (
    NotExpressibleError,
    PixelDecoder,
    diffusers_transformer_config,
    export_checkpoint,
    from_diffusers_state_dict,
    load_dit,
    name_table,
    read_checkpoint,
    save_dit,
    to_diffusers_state_dict,
    use_reference_timestep_embedding,
)
from dit_lightning.models import DiT, build_dit, model_config
from dit_lightning.models.dit import DIT_CONFIGS
from dit_lightning.models.pruning import prune_depth, prune_heads, prune_mlp
from dit_lightning.module import DiTModule
from dit_lightning.sampling import build_scheduler, sample_latents
from dit_lightning.vae import decode_latents, load_vae
from tests.helpers.data import make_random_store, make_tiny_vae
from tests.helpers.models import randomize
from tests.helpers.training import TINY_MODULE, DictDataset, trainer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*accelerate.*"),
]
TIMESTEPS = [0, 1, 10, 100, 250, 500, 750, 999]


def _dit(**kw):
    cfg = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    cfg.update(kw)
    torch.manual_seed(0)
    return randomize(DiT(**cfg)).eval()


def _export(tmp_path, net, name="diff", **kw):
    ckpt = save_dit(net, tmp_path / f"{name}.pt", ema=net, extra_args={"vae": kw.pop("vae_arg", "none/pixels")})
    return export_checkpoint(str(ckpt), str(tmp_path / name), format="diffusers", **kw)


def _max_diff_per_timestep(net, transformer, n_classes):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, net.in_channels, net.input_size, net.input_size, generator=g)
    y = torch.tensor([0, 3, n_classes - 1, n_classes])  # the null class too
    out = {}
    with torch.no_grad():
        for t in TIMESTEPS:
            tt = torch.full((4,), t)
            out[t] = (net(x, tt, y) - transformer(x, timestep=tt, class_labels=y).sample).abs().max().item()
    return out


# ---------------------------------------------------------------------------------------
# The name rule
# ---------------------------------------------------------------------------------------


def test_the_name_rule_covers_every_parameter_of_both_networks_and_is_strict():
    net = _dit(depth=3)
    table = name_table(3)
    assert {ours for _, ours, _ in table} | {"pos_embed"} == set(net.state_dict())
    theirs = DiTTransformer2DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=3, sample_size=8,
        patch_size=2, num_embeds_ada_norm=10,
    )  # fmt: skip
    assert {name for _, _, names in table for name in names} == set(theirs.state_dict())

    sd = net.state_dict()
    mapped = to_diffusers_state_dict(sd)
    back = from_diffusers_state_dict(mapped, grid_size=4)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match=r"unexpected \['blocks.0.attn.q_norm.weight'\]"):
        to_diffusers_state_dict({**sd, "blocks.0.attn.q_norm.weight": torch.ones(8)})
    with pytest.raises(ValueError, match=r"missing \['transformer_blocks.1.attn1.to_k.bias'\]"):
        from_diffusers_state_dict({k: v for k, v in mapped.items() if k != "transformer_blocks.1.attn1.to_k.bias"}, 4)
    # diffusers keeps a timestep/label embedder per block; a DiT shares one
    diverged = dict(mapped)
    name = "transformer_blocks.2.norm1.emb.timestep_embedder.linear_1.weight"
    diverged[name] = mapped[name] + 1e-3
    with pytest.raises(ValueError, match="own timestep/label embedders"):
        from_diffusers_state_dict(diverged, 4)


@pytest.mark.parametrize("name", sorted(DIT_CONFIGS))
def test_every_named_dit_maps_onto_diffusers_shapes(name):
    """All twelve sizes (S/B/L/XL x patch 2/4/8) at 256 and 512 px, on the meta device: the
    mapped state dict has exactly the names and shapes of diffusers' model of that config."""
    for latent in (32, 64):
        with torch.device("meta"):
            net = build_dit(name, input_size=latent)
            theirs = DiTTransformer2DModel(**diffusers_transformer_config(model_config(net)))
        mapped = to_diffusers_state_dict(net.state_dict())
        assert {k: v.shape for k, v in mapped.items()} == {k: v.shape for k, v in theirs.state_dict().items()}


# ---------------------------------------------------------------------------------------
# diffusers computes the DiT (with the reference timestep embedding)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch",
    [
        dict(patch_size=1),
        dict(patch_size=2),
        dict(patch_size=4),
        dict(patch_size=8),
        dict(patch_size=2, learn_sigma=False, in_channels=3, num_heads=2),
    ],
    ids=["p1", "p2", "p4", "p8", "p2-fixed-sigma-3ch"],
)
def test_exported_transformer_is_the_dit_with_the_reference_timestep_embedding(tmp_path, arch):
    net = _dit(**arch)
    _export(tmp_path, net)
    transformer = DiTTransformer2DModel.from_pretrained(tmp_path / "diff" / "transformer").eval()
    as_built = _max_diff_per_timestep(net, transformer, 10)
    assert as_built[0] == pytest.approx(0, abs=1e-5)  # t = 0: the frequencies do not matter
    assert max(as_built.values()) > 1e-3  # downscale_freq_shift=1: another timestep embedding
    use_reference_timestep_embedding(transformer)
    exact = _max_diff_per_timestep(net, transformer, 10)
    assert max(exact.values()) < 1e-5, exact


# ---------------------------------------------------------------------------------------
# Pipelines: latent (with a VAE) and pixel-space
# ---------------------------------------------------------------------------------------


def _pipeline_vs_ours(pipe, net, labels, sampler, cfg, steps, clip):
    """Images of DiTPipeline with `sampler`'s scheduler, and of dit-lightning from the same x_T."""
    pipe.scheduler = build_scheduler(sampler, thresholding=clip)
    pipe.set_progress_bar_config(disable=True)
    shape = (len(labels), net.in_channels, net.input_size, net.input_size)
    x_t = torch.randn(shape, generator=torch.Generator().manual_seed(0))  # what the pipeline draws
    kw = dict(guidance_scale=cfg, num_inference_steps=steps, output_type="pt")
    theirs = pipe(class_labels=labels, generator=torch.Generator().manual_seed(0), **kw).images
    lat = sample_latents(net, labels, sampler=sampler, num_steps=steps, cfg_scale=cfg, noise=x_t, clip_denoised=clip)
    return theirs, lat


def test_latent_export_loads_offline_in_dit_pipeline_and_samples_like_dit_lightning(tmp_path):
    vae_dir = make_tiny_vae(str(tmp_path / "tiny_vae"))
    store = make_random_store(str(tmp_path / "store"), 8, latent_shape=(4, 8, 8), num_classes=1000)
    net = _dit(num_classes=1000)  # DiTPipeline's null class is 1000: guidance needs 1000 classes
    report = _export(tmp_path, net, vae=vae_dir, store=store.path)
    assert report["vae_status"] == "included" and report["scheduler_class"] == "DPMSolverMultistepScheduler"
    out = tmp_path / "diff"
    assert {p.name for p in out.iterdir()} >= {"transformer", "scheduler", "vae", "model_index.json", "README.md"}
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").is_file()

    pipe = DiTPipeline.from_pretrained(out)  # offline, no arguments
    assert pipe.vae.config.scaling_factor == pytest.approx(0.18215)
    assert pipe.get_label_ids(["c207", "c999"]) == [207, 999]
    use_reference_timestep_embedding(pipe)
    vae = load_vae(vae_dir)
    for sampler, cfg in [("dpm++2m", 1.0), ("dpm++2m", 4.0), ("unipc", 4.0)]:
        theirs, lat = _pipeline_vs_ours(pipe, net, [207, 1, 999], sampler, cfg, steps=6, clip=False)
        ours = decode_latents(lat, vae, 0.18215)
        assert theirs.shape == (3, 3, 16, 16)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)

    # read back: the VAE and scale factor come from vae/
    loaded = load_dit(str(out))
    assert loaded.vae == str((out / "vae").resolve()) and loaded.scale_factor == pytest.approx(0.18215)


def test_pixel_export_has_no_vae_and_samples_through_a_pixel_decoder_with_the_clamp(tmp_path):
    net = _dit(in_channels=1, num_heads=2)
    report = _export(tmp_path, net)
    out = tmp_path / "diff"
    index = json.loads((out / "model_index.json").read_text())
    assert report["vae_status"] == "pixels" and index["vae"] == [None, None] and not (out / "vae").exists()
    assert "PixelDecoder" in (out / "README.md").read_text()
    config = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert config["thresholding"] is True and config["sample_max_value"] == 1.0  # x0 clamped to [-1, 1]
    with pytest.raises(ValueError, match="expected.*vae"):
        DiTPipeline.from_pretrained(out)  # a pixel model has nothing to decode: say what decodes
    pipe = use_reference_timestep_embedding(DiTPipeline.from_pretrained(out, vae=PixelDecoder()))
    for sampler in ("dpm++2m", "unipc", "deis"):
        theirs, lat = _pipeline_vs_ours(pipe, net, [0, 4, 9], sampler, 1.0, steps=8, clip=True)
        torch.testing.assert_close(theirs, ((lat + 1) / 2).clamp(0, 1), rtol=0, atol=1e-4)


def test_hub_vae_not_available_offline_is_named_instead_of_written(tmp_path):
    report = _export(tmp_path, _dit(), vae_arg="ema")  # the reference's --vae ema
    out = tmp_path / "diff"
    assert report["vae_status"] == "missing" and report["vae"] == "stabilityai/sd-vae-ft-ema"
    assert json.loads((out / "model_index.json").read_text())["vae"] == [None, None]
    assert 'vae=AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema")' in (out / "README.md").read_text()
    assert load_dit(str(out)).vae == "stabilityai/sd-vae-ft-ema"  # recorded in dit_lightning.json


# ---------------------------------------------------------------------------------------
# Round trips, safetensors, and every --checkpoint taking them
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning")
    module = DiTModule(**TINY_MODULE, ema_decay=0.5)
    t = trainer(max_steps=2, default_root_dir=tmp)
    t.fit(module, DataLoader(DictDataset(), batch_size=8))
    path = tmp / "run.ckpt"
    t.save_checkpoint(path)
    return path


def test_round_trips_give_bit_identical_weights(lightning_ckpt, tmp_path):
    src = read_checkpoint(lightning_ckpt)
    ema, trained = src.weights("ema"), src.weights("model")
    assert not all(torch.equal(ema[k], trained[k]) for k in ema)

    def same(sd, ref):
        return set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) and sd[k].dtype == ref[k].dtype for k in ref)

    d1 = export_checkpoint(str(lightning_ckpt), str(tmp_path / "d1"), format="diffusers")["output"]
    assert read_checkpoint(d1).format == "diffusers" and same(read_checkpoint(d1).weights(), ema)
    raw = export_checkpoint(str(lightning_ckpt), str(tmp_path / "raw"), format="diffusers", weights="raw")["output"]
    assert same(read_checkpoint(raw).weights(), trained)
    st = export_checkpoint(str(lightning_ckpt), str(tmp_path / "w.safetensors"), format="safetensors")["output"]
    assert read_checkpoint(st).format == "safetensors" and same(read_checkpoint(st).weights(), ema)
    # diffusers -> diffusers, -> safetensors, -> reference: the same tensors all along
    d2 = export_checkpoint(d1, str(tmp_path / "d2"), format="diffusers")["output"]
    a = load_file(os.path.join(d1, "transformer", "diffusion_pytorch_model.safetensors"))
    b = load_file(os.path.join(d2, "transformer", "diffusion_pytorch_model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    st2 = export_checkpoint(d1, str(tmp_path / "again.safetensors"), format="safetensors")["output"]
    assert same(read_checkpoint(st2).weights(), ema)
    ref = export_checkpoint(st, str(tmp_path / "ref.pt"), format="reference")["output"]
    assert same(read_checkpoint(ref).weights("ema"), ema)
    # re-exporting over an export replaces it; any other directory is refused
    export_checkpoint(str(lightning_ckpt), d1, format="diffusers", weights="raw")
    assert same(read_checkpoint(d1).weights(), trained)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a diffusers export"):
        export_checkpoint(str(lightning_ckpt), str(tmp_path / "mine"), format="diffusers")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_safetensors_export_needs_no_pickle_and_records_the_settings(tmp_path):
    net = _dit(hidden_size=48, num_heads=2)  # 2 heads: not hidden/64, only the metadata says so
    ckpt = save_dit(net, tmp_path / "n.pt", ema=net, extra_args={"noise_schedule": "cosine", "vae": "none/pixels"})
    path = export_checkpoint(str(ckpt), str(tmp_path / "n.safetensors"), format="safetensors")["output"]
    tensors = load_file(path)  # safetensors' own reader: no pickle anywhere
    assert set(tensors) == set(net.state_dict())
    loaded = load_dit(path)
    assert loaded.config["num_heads"] == 2 and not loaded.notes
    assert loaded.objective.noise_schedule == "cosine" and loaded.vae == "none/pixels"
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([5, 900]), torch.tensor([1, 10])
    assert torch.equal(loaded.net(x, t, y), net(x, t, y))
    # a plain safetensors state dict without our metadata: a raw checkpoint (heads guessed, with a note)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp_path / "plain.bin"))
    plain = load_dit(str(tmp_path / "plain.bin"))  # recognised by its header, not its name
    assert plain.format == "safetensors" and any("head count" in n for n in plain.notes)


def test_diffusers_made_models_import_strictly(tmp_path):
    """A DiTTransformer2DModel saved by diffusers itself (its config says norm_eps 1e-5): the
    transformer folder, the bare weights file next to its config, and a pipeline directory."""
    torch.manual_seed(0)
    theirs = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, num_embeds_ada_norm=10,
    ).eval()  # fmt: skip
    with torch.no_grad():  # a converted DiT: every block holds the same embedders
        for p in theirs.parameters():
            p.normal_(0, 0.2)
        for block in theirs.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(theirs.transformer_blocks[0].norm1.emb.state_dict())
    theirs.save_pretrained(tmp_path / "t")
    for path in (tmp_path / "t", tmp_path / "t" / "diffusion_pytorch_model.safetensors"):
        loaded = load_dit(str(path))
        assert loaded.config["num_heads"] == 2 and loaded.config["hidden_size"] == 32
        assert any("norm_eps=1e-05" in n for n in loaded.notes)
        use_reference_timestep_embedding(theirs)  # also sets the reference's LayerNorm eps
        assert max(_max_diff_per_timestep(loaded.net, theirs, 10).values()) < 1e-5

    fresh = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, num_layers=2, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10,
    )  # fmt: skip
    fresh.save_pretrained(tmp_path / "fresh")  # diffusers' own init: each block its own embedders
    with pytest.raises(ValueError, match="own timestep/label embedders"):
        read_checkpoint(tmp_path / "fresh")
    with pytest.raises(ValueError, match="is a directory but no checkpoint"):
        read_checkpoint(tmp_path)


def test_architectures_diffusers_cannot_express_are_refused_with_the_reason(tmp_path):
    net = _dit(depth=3)
    cases = {
        "head-pruned": (prune_heads(net, 2), "head-pruned"),
        "mlp-pruned": (prune_mlp(net, keep_ratio=0.5), "MLP has 64 channels, not 4 x 32"),
        "qk-norm": (_dit(qk_norm=True), "qk_norm"),
        "no-null-row": (_dit(class_dropout_prob=0.0), "no null-class row"),
    }
    for name, (model, reason) in cases.items():
        with pytest.raises(NotExpressibleError, match=reason):
            _export(tmp_path, model, name=name)
        assert not (tmp_path / name).exists()
        export_checkpoint(str(tmp_path / f"{name}.pt"), str(tmp_path / f"{name}.safetensors"), format="safetensors")
    # depth-pruned (and any depth / width / heads / patch): expressible
    shallow = prune_depth(net, [0, 2])
    _export(tmp_path, shallow, name="shallow")
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 600]), torch.tensor([1, 2])
    assert torch.equal(load_dit(str(tmp_path / "shallow")).net(x, t, y), shallow(x, t, y))


def test_init_from_and_the_sample_command_take_diffusers_directories_and_safetensors(tmp_path):
    from dit_lightning.commands.sample import sample

    net = _dit(in_channels=1)
    _export(tmp_path, net)
    export_checkpoint(str(tmp_path / "diff.pt"), str(tmp_path / "w.safetensors"), format="safetensors")
    for source in (tmp_path / "diff", tmp_path / "w.safetensors"):
        module = DiTModule(
            model="custom", latent_shape=(1, 8, 8), num_classes=10, depth=2, hidden_size=32, num_heads=4,
            patch_size=2, init_from=str(source),
        )  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(module.model.state_dict().values(), net.state_dict().values()))
        assert module.ema is not None and torch.equal(module.ema.pos_embed, net.pos_embed)
    res = sample(
        str(tmp_path / "diff"), str(tmp_path / "out"), labels=[1, 2], sampler="dpm++2m", num_steps=4,
        progress=False, device="cpu",
    )  # fmt: skip
    config = json.loads((tmp_path / "out" / "sample_config.json").read_text())
    assert res["complete"] and config["checkpoint_format"] == "diffusers" and config["vae"] == "none/pixels"
    assert config["sampler"] == "dpm++2m" and config["clip_denoised"] is True
