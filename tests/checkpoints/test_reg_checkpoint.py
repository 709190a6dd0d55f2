"""REG's SiT checkpoints (github.com/Martinser/REG, ``train.py``'s ``{model, ema, opt, args}`` and raw
state dicts) read as DiTs with a class token, in this project's flow time; the exports keep the token,
and the diffusers export refuses it by name."""

import argparse
import json

import numpy as np
import pytest
import torch

from dit_lightning.checkpoints import NotExpressibleError, export_checkpoint, load_dit, read_checkpoint
from dit_lightning.checkpoints.reg import reg_state_dict
from dit_lightning.diffusion import FlowMatching
from dit_lightning.sampling import sample_latents
from tests.helpers import reg_reference as reg

pytestmark = pytest.mark.usefixtures("one_thread")


def reg_sit(seed: int) -> torch.nn.Module:
    """A tiny REG SiT (2 heads of 64: what a file without a recorded head count is guessed to have),
    every weight random, its zero-initialised layers too."""
    torch.manual_seed(seed)
    model = reg.SiT(
        input_size=8, patch_size=2, in_channels=4, hidden_size=128, decoder_hidden_size=128, encoder_depth=1,
        depth=2, num_heads=2, z_dims=[32], projector_dim=48, qk_norm=False,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed" and not torch.count_nonzero(p):
                p.normal_(0, 0.3)
    return model.eval()


def inputs():
    g = torch.Generator().manual_seed(0)
    x, token = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 32, generator=g)
    return x, token, torch.tensor([0.2, 0.7]), torch.tensor([3, 1000])


def outputs(net, x, token, t, y):
    with torch.no_grad():
        return net(x, t, y, class_token=token)


def test_a_reg_training_checkpoint_loads_in_flow_time_and_exports_with_its_token(tmp_path):
    model, ema = reg_sit(0), reg_sit(1)
    args = argparse.Namespace(
        model="SiT-tiny", path_type="linear", prediction="v", weighting="uniform", num_classes=1000, cls=0.03,
        proj_coeff=0.5, encoder_depth=1, enc_type="dinov2-vit-b",
    )  # fmt: skip
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": {}, "args": args}, tmp_path / "reg.pt")
    loaded = load_dit(str(tmp_path / "reg.pt"))
    assert loaded.config["class_token_dim"] == 32 and loaded.net.class_token_dim == 32
    assert loaded.objective == FlowMatching() and loaded.weights == "ema"
    assert any("REG's SiT" in note for note in loaded.checkpoint.meta["notes"])
    assert loaded.checkpoint.optimizer is None  # keyed by position over REPA's projector too
    x, token, t, y = inputs()
    with torch.no_grad():
        v_reg, _, token_v_reg = ema(x, 1 - t, y, cls_token=token)  # REG's time: ours 1 - t, velocity negated
    v, token_v = outputs(loaded.net, x, token, t, y)
    torch.testing.assert_close(v, -v_reg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(token_v, -token_v_reg, rtol=1e-5, atol=1e-5)
    latents = sample_latents(loaded.net, [1, 2], objective=loaded.objective, sampler="sde-euler", num_steps=3)
    assert latents.shape == (2, 4, 8, 8) and torch.isfinite(latents).all()

    # exports keep cls_embedder.* and final_layer.linear_cls.* and record class_token_dim
    for fmt in ("reference", "safetensors", "raw"):
        out = tmp_path / f"export.{'safetensors' if fmt == 'safetensors' else 'pt'}"
        export_checkpoint(str(tmp_path / "reg.pt"), str(out), format=fmt)
        back = read_checkpoint(out)
        assert back.args["model_config"]["class_token_dim"] == 32, fmt
        assert {"cls_embedder.proj.weight", "cls_embedder.norm.bias", "final_layer.linear_cls.weight"} <= set(
            back.weights()
        )
        again = load_dit(back)
        assert again.objective == FlowMatching(), fmt
        for a, b in zip(outputs(again.net, x, token, t, y), (v, token_v)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        out.unlink()
    sidecar = json.loads((tmp_path / "export.pt.json").read_text())
    assert sidecar["args"]["model_config"]["class_token_dim"] == 32
    with pytest.raises(NotExpressibleError, match="REG's class token"):
        export_checkpoint(str(tmp_path / "reg.pt"), str(tmp_path / "pipe"), format="diffusers")


def test_a_raw_reg_state_dict_and_a_token_position_embedding(tmp_path):
    sd = reg_sit(0).state_dict()
    torch.save(sd, tmp_path / "raw.pt")
    loaded = load_dit(str(tmp_path / "raw.pt"))
    assert loaded.net.class_token_dim == 32 and loaded.objective is None  # a raw file records nothing
    assert not any(k.startswith("projectors.") for k in loaded.net.state_dict())  # REPA's projector: training only
    moved = {**sd, "pos_embed": sd["pos_embed"] + 1}
    with pytest.raises(ValueError, match="first row of pos_embed.*not zero"):
        reg_state_dict(moved)


def test_regs_arguments_read_as_sits():
    from dit_lightning.checkpoints.architecture import _recorded_heads
    from dit_lightning.checkpoints.reg import reg_args

    read = reg_args({"model": "SiT-XL/2", "path_type": "cosine", "prediction": "v", "cls": 0.03})
    assert (read["path_type"], read["prediction"], _recorded_heads(read)) == ("gvp", "velocity", 16)
    with pytest.raises(ValueError, match="linear or cosine"):
        reg_args({"path_type": "edm"})


def test_sample_samples_a_reg_checkpoint_with_the_token_guided(tmp_path):
    from dit_lightning.commands.sample import sample
    from tests.helpers.data import make_tiny_vae

    args = argparse.Namespace(model="SiT-tiny", path_type="linear", prediction="v", num_classes=1000)
    sd = reg_sit(0).state_dict()
    torch.save({"model": sd, "ema": sd, "args": args}, tmp_path / "reg.pt")
    common = dict(labels=[1, 2], num_steps=3, vae=make_tiny_vae(str(tmp_path / "vae")), device="cpu", progress=False,
                  grid_size=2, cfg_scale=2.0, cfg_interval=(0.15, 1.0))  # fmt: skip
    sample(str(tmp_path / "reg.pt"), str(tmp_path / "a"), class_token_cfg_scale=0.0, **common)
    sample(str(tmp_path / "reg.pt"), str(tmp_path / "b"), **common)  # the token guided as the latents
    config = json.loads((tmp_path / "a" / "sample_config.json").read_text())
    assert (config["objective"], config["sampler"], config["class_token_cfg_scale"]) == ("flow", "sde-euler", 0.0)
    a, b = (np.load(next((tmp_path / d).glob("*.npz")))["arr_0"] for d in ("a", "b"))
    assert a.shape == b.shape == (2, 16, 16, 3)  # the tiny VAE decodes 8 x 8 latents to 16 x 16 images
    assert not np.array_equal(a, b)  # the token's guidance reaches the images
