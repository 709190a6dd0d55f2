"""Reading checkpoints: reference and Lightning files with their recorded architecture and
sampling settings, and clear refusals of files that are not DiT checkpoints."""

import pytest
import torch

from dit_lightning.checkpoints import load_dit as load_model
from dit_lightning.checkpoints import read_checkpoint
from dit_lightning.commands.sample import sample
from dit_lightning.models import DiT
from dit_lightning.sampling import sample_latents
from tests.helpers.models import random_dit
from tests.helpers.samples import FAST

pytestmark = pytest.mark.usefixtures("one_thread")


def test_reference_and_lightning_checkpoints(tmp_path):
    model, ema = random_dit(seed=0), random_dit(seed=1)
    ref = tmp_path / "ref.pt"
    torch.save(
        {"model": model.state_dict(), "ema": ema.state_dict(), "opt": {}, "args": {"model": "custom", "num_heads": 4}},
        ref,
    )
    y = torch.tensor([4, 2])
    for weights, net in (("ema", ema), ("raw", model)):
        got = load_model(str(ref), weights=weights)
        assert got.config["num_heads"] == 4 and got.weights == weights
        torch.testing.assert_close(sample_latents(got.net, y, num_steps=3), sample_latents(net, y, num_steps=3))
    # Lightning: heads (4, not hidden/64 = 1) and diffusion settings come from the hyper-parameters
    sd = {f"model.{k}": v for k, v in model.state_dict().items()} | {f"ema.{k}": v for k, v in ema.state_dict().items()}
    hp = {"model": "custom", "num_heads": 4, "latent_shape": (4, 8, 8), "eval_weights": "ema",
          "noise_schedule": "linear", "diffusion_steps": 1000, "vae": "none/pixels", "sample_steps": 5,
          "sampler": "ddim", "cfg_scale": 2.0, "guide_channels": None}  # fmt: skip
    light = tmp_path / "last.ckpt"
    torch.save({"state_dict": sd, "hyper_parameters": hp}, light)
    got = load_model(str(light))
    assert got.format == "lightning" and got.config["num_heads"] == 4 and got.vae == "none/pixels"
    assert got.sampling_defaults == {"sample_steps": 5, "sampler": "ddim", "cfg_scale": 2.0, "guide_channels": None}
    torch.testing.assert_close(sample_latents(got.net, y, num_steps=3), sample_latents(ema, y, num_steps=3))
    with pytest.raises(ValueError, match="need a VAE"):  # 4-channel latents cannot be shown as pixels
        sample(str(ref), str(tmp_path / "o"), labels=[1], vae="none/pixels", **FAST)


def test_read_checkpoint_refuses_non_dit_and_truncated_files(tmp_path):
    bad = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.zeros(2)}, bad)
    with pytest.raises(ValueError, match="not a DiT checkpoint"):
        read_checkpoint(bad)
    src = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    good = tmp_path / "good.pt"
    torch.save(src.state_dict(), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(ValueError, match="is truncated or corrupt"):
        read_checkpoint(truncated)
