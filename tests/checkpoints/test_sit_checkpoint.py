"""SiT's checkpoints (github.com/willisma/SiT) load strictly: a raw state dict shaped like SiT-S/2 (its
width, heads and patch; 2 blocks and 8 x 8 latents, for speed) with SiT's parameter names, with 8
output channels (its learn_sigma networks and the released SiT-XL-2-256x256.pt) or 4; its train.py
format records the flow objective; a flow DiTModule starts from one (init_from) with the same
outputs."""

import argparse

import pytest
import torch

from dit_lightning.checkpoints import (
    DiTCheckpoint,
    NotExpressibleError,
    export_diffusers,
    load_dit,
    read_checkpoint,
)
from dit_lightning.diffusion import FlowMatching, recorded_objective_name
from dit_lightning.module import DiTModule
from tests.helpers.reference_forward import reference_forward
from tests.helpers.sit_reference import sit_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(depth=2, input_size=8)  # SiT-S/2's width (384), heads (6) and patch (2)


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 8, 8, generator=g), torch.tensor([0.25, 0.8]), torch.tensor([3, 1000])


def test_raw_sit_s2_loads_strictly_with_8_or_4_output_channels(tmp_path):
    for learn_sigma in (True, False):
        sd = sit_state_dict(**SMALL, learn_sigma=learn_sigma)
        path = tmp_path / f"sit-{learn_sigma}.pt"
        torch.save(sd, path)
        loaded = load_dit(str(path))
        assert loaded.config["learn_sigma"] is learn_sigma and loaded.config["num_heads"] == 6
        assert loaded.objective is None  # a raw file records nothing
        for k, v in loaded.net.state_dict().items():
            assert torch.equal(v, sd[k]), k
        x, t, y = inputs()
        with torch.no_grad():
            ours = loaded.net(x, t, y)[:, :4]  # SiT.forward keeps the first 4 channels
            independent = reference_forward(
                sd, x, t, y, patch=2, heads=6, depth=2, out_channels=8 if learn_sigma else 4
            )
        torch.testing.assert_close(ours, independent[:, :4], rtol=1e-4, atol=1e-5)


def test_sit_training_checkpoint_records_the_flow_objective(tmp_path):
    sd = sit_state_dict(**SMALL)
    args = argparse.Namespace(model="SiT-S/2", path_type="GVP", prediction="noise", loss_weight="likelihood",
                              train_eps=1e-5, sample_eps=1e-3, image_size=64, num_classes=1000)  # fmt: skip
    torch.save({"model": sd, "ema": sd, "opt": {}, "args": args}, tmp_path / "0050000.pt")
    ckpt = read_checkpoint(tmp_path / "0050000.pt")
    assert ckpt.format == "reference" and recorded_objective_name(ckpt.args) == "flow"
    loaded = load_dit(ckpt)
    want = FlowMatching(path_type="gvp", prediction="noise", loss_weight="likelihood", train_eps=1e-5, sample_eps=1e-3)
    assert loaded.objective == want  # the epsilons it records
    velocity = {**vars(args), "path_type": "Linear", "prediction": "velocity", "loss_weight": None}
    torch.save({"model": sd, "ema": sd, "args": argparse.Namespace(**velocity)}, tmp_path / "v.pt")
    assert load_dit(str(tmp_path / "v.pt")).objective == FlowMatching()  # SiT's epsilons unused for velocity
    assert recorded_objective_name({"model": "DiT-XL/2"}) == "ddpm" and recorded_objective_name({}) is None


def test_a_flow_module_starts_from_sits_released_layout(tmp_path):
    sd = sit_state_dict(**SMALL)  # 8 output channels, the last 4 never used by SiT
    torch.save(sd, tmp_path / "SiT-S-2-256.pt")
    module = DiTModule(
        model="DiT-S/2", depth=2, latent_shape=(4, 8, 8), num_classes=1000, objective="flow",
        init_from=str(tmp_path / "SiT-S-2-256.pt"),
    )  # fmt: skip
    assert module.model.out_channels == 4
    x, t, y = inputs()
    with torch.no_grad():
        expected = reference_forward(sd, x, t, y, patch=2, heads=6, depth=2, out_channels=8)[:, :4]
        torch.testing.assert_close(module.model.eval()(x, t, y), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(module.ema(x, t, y), expected, rtol=1e-4, atol=1e-5)


def test_the_diffusers_export_refuses_a_flow_model(tmp_path):
    sd = sit_state_dict(**SMALL)
    ckpt = DiTCheckpoint(str(tmp_path / "sit.ckpt"), "lightning", sd, sd, {"objective": "flow"})
    with pytest.raises(NotExpressibleError, match="trained with objective flow"):
        export_diffusers(ckpt, tmp_path / "pipe")
    assert not (tmp_path / "pipe").exists()


def test_sample_declares_the_objective_of_a_raw_sit_file(tmp_path):
    import json

    from dit_lightning.commands.sample import sample
    from tests.helpers.data import make_tiny_vae

    torch.save(sit_state_dict(**SMALL), tmp_path / "SiT-S-2.pt")  # records nothing: DDPM unless declared
    vae = make_tiny_vae(str(tmp_path / "vae"))
    common = dict(labels=[1, 2], num_steps=3, vae=vae, device="cpu", progress=False, write_npz=False, grid_size=2)
    sample(str(tmp_path / "SiT-S-2.pt"), str(tmp_path / "flow"), objective="flow", **common)
    config = json.loads((tmp_path / "flow" / "sample_config.json").read_text())
    assert (config["objective"], config["sampler"]) == ("flow", "sde-euler")  # SiT's FID sampler by default
    assert len(list((tmp_path / "flow" / "samples").glob("*.png"))) == 2
    with pytest.raises(ValueError, match="does not sample a model trained with objective ddpm"):
        sample(str(tmp_path / "SiT-S-2.pt"), str(tmp_path / "ddpm"), sampler="ode-euler", **common)
    args = argparse.Namespace(
        model="SiT-S/2", path_type="Linear", prediction="velocity", image_size=64, num_classes=1000
    )
    torch.save({"model": sit_state_dict(**SMALL), "args": args}, tmp_path / "sit-train.pt")
    with pytest.raises(ValueError, match="records objective flow"):
        sample(str(tmp_path / "sit-train.pt"), str(tmp_path / "x"), objective="ddpm", **common)
