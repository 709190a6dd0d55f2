"""``dit-lightning convert-vavae``: a randomly initialised VA-VAE (LightningDiT's LDM AutoencoderKL,
transcribed in tests/helpers/vavae_reference.py) of a small variant of their config, saved as their
checkpoint, converted and loaded by diffusers: the same encoder moments and decoded images."""

import json

import pytest
import torch
import yaml

from dit_lightning.checkpoints.vavae import NotConvertibleError, diffusers_vae_config
from dit_lightning.cli import main
from dit_lightning.commands.convert_vavae import convert_vavae
from tests.helpers import vavae_reference as ldm

pytestmark = pytest.mark.usefixtures("one_thread")

# LightningDiT's tokenizer/configs/vavae_f16d32.yaml with tiny channels and images: the same structure
# (five levels, f16, attention at the last level: resolution / 16, 32 latent channels)
CONFIG = """
ckpt_path: /path/to/checkpoint.pt
model:
  base_learning_rate: 1.0e-04
  target: ldm.models.autoencoder.AutoencoderKL
  params:
    monitor: val/rec_loss
    embed_dim: 32
    use_vf: dinov2
    reverse_proj: true
    lossconfig:
      target: ldm.modules.losses.LPIPSWithDiscriminator
      params: {disc_start: 1, kl_weight: 1.0e-06, disc_weight: 0.5}
    ddconfig:
      double_z: true
      z_channels: 32
      resolution: 32
      in_channels: 3
      out_ch: 3
      ch: 32
      ch_mult: [1, 1, 2, 2, 4]
      num_res_blocks: 2
      attn_resolutions: [2]
      dropout: 0.0
"""


def vavae(params):
    torch.manual_seed(0)
    model = ldm.AutoencoderKL(
        params["ddconfig"], params["lossconfig"], params["embed_dim"], use_vf="dinov2", reverse_proj=True,
        vf_feature_dim=16,
    ).eval()  # fmt: skip
    with torch.no_grad():  # GroupNorm starts at 1 / 0: random affine parameters exercise their mapping too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return model


def test_convert_vavae_gives_the_same_moments_and_images(tmp_path, capsys):
    from diffusers.models import AutoencoderKL

    params = yaml.safe_load(CONFIG)["model"]["params"]
    model = vavae(params)
    state = {
        **model.state_dict(),
        "loss.discriminator.main.0.weight": torch.zeros(2),
        "foundation_model.x": torch.ones(1),
    }
    torch.save({"state_dict": state, "global_step": 7}, tmp_path / "vavae.pt")  # as tokenizer/vavae.py reads it
    (tmp_path / "vavae.yaml").write_text(CONFIG)
    out = tmp_path / "vae"
    argv = ["--checkpoint", str(tmp_path / "vavae.pt"), "--config", str(tmp_path / "vavae.yaml"), "--output", str(out)]
    main(["convert-vavae", *argv])  # the command line, in process
    printed = capsys.readouterr().out
    assert "left out the training-only weights foundation_model.*, linear_proj.*, loss.*" in printed
    assert "scaling_factor 1.0" in printed and "--latent_norm channel_stats" in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["scaling_factor"] == 1.0 and cfg["latent_channels"] == 32
    assert (
        cfg["down_block_types"][-1] == "AttnDownEncoderBlock2D" and cfg["up_block_types"][0] == "AttnUpDecoderBlock2D"
    )
    # in float64, where the two implementations' different summation orders (diffusers' SDPA, LDM's bmm) leave
    # ~1e-15 and a wrong mapping still shows; in float32 they differ by ~3e-5 on images of std ~1
    vae = AutoencoderKL.from_pretrained(out).eval().double()
    model.double()
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        theirs = model.encode(x)
        ours = vae.encode(x).latent_dist
        z = theirs.mean + 0.5 * torch.randn_like(theirs.mean)
        theirs_images, ours_images = model.decode(z), vae.decode(z).sample
    assert ours.mean.shape == (2, 32, 2, 2)  # f16
    torch.testing.assert_close(ours.mean, theirs.mean, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.logvar, theirs.logvar, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_images, theirs_images, rtol=0, atol=1e-5)
    assert theirs_images.std() > 0.1  # not a degenerate network

    with pytest.raises(SystemExit):
        main(["convert-vavae", *argv])
    assert "--overwrite true" in capsys.readouterr().err  # one line, no traceback
    files = [str(tmp_path / "vavae.pt"), str(tmp_path / "vavae.yaml")]
    convert_vavae(*files, str(out), overwrite=True)  # an earlier conversion is replaced
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not a diffusers VAE directory"):
        convert_vavae(*files, str(tmp_path / "other"), overwrite=True)
    bad = yaml.safe_load(CONFIG)
    bad["model"]["params"]["ddconfig"]["attn_resolutions"] = [4]  # the checkpoint attends at 2 x 2
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="does not match --config"):
        convert_vavae(files[0], str(tmp_path / "bad.yaml"), str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()


def test_what_diffusers_cannot_represent_is_refused():
    params = yaml.safe_load(CONFIG)["model"]["params"]
    assert diffusers_vae_config(params)["block_out_channels"] == [32, 32, 64, 64, 128]
    for change, message in (
        (dict(ch_mult=[2, 2, 4]), "ch_mult"),
        (dict(use_linear_attn=True), "linear attention"),
        (dict(z_channels=16), "embed_dim 32 != z_channels 16"),
        (dict(attn_resolutions=[5]), "match no level"),
    ):
        with pytest.raises(NotConvertibleError, match=message):
            diffusers_vae_config({**params, "ddconfig": {**params["ddconfig"], **change}})


def test_the_published_f16d32_config_maps_every_weight():
    """Their vavae_f16d32.yaml itself (ch 128, resolution 256, attention at 16 x 16), on the meta device:
    every weight of their network has its diffusers name and shape."""
    from diffusers.models import AutoencoderKL

    from dit_lightning.checkpoints.vavae import vavae_state_dict

    params = yaml.safe_load(CONFIG)["model"]["params"]
    params["ddconfig"].update(ch=128, resolution=256, attn_resolutions=[16])
    cfg = diffusers_vae_config(params)
    assert cfg["down_block_types"] == ["DownEncoderBlock2D"] * 4 + ["AttnDownEncoderBlock2D"]
    with torch.device("meta"):
        theirs = ldm.AutoencoderKL(params["ddconfig"], params["lossconfig"], params["embed_dim"], use_vf="dinov2")
        ours = AutoencoderKL(**cfg)
    mapped, ignored = vavae_state_dict({"state_dict": theirs.state_dict()}, levels=5)
    assert ignored == ["linear_proj."]
    assert {k: v.shape for k, v in mapped.items()} == {k: v.shape for k, v in ours.state_dict().items()}
