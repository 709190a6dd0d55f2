"""REG's class token sampled jointly with the latents (github.com/Martinser/REG, ``samplers.py``): a tiny
random REG SiT, loaded into the DiT (``reg_state_dict``), gives REG's samples from the same noises;
every flow sampler takes a class-token DiT; DDPM refuses one."""

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dit_lightning.checkpoints import load_dit_weights
from dit_lightning.checkpoints.reg import reg_state_dict
from dit_lightning.diffusion import FlowMatching
from dit_lightning.models.dit import DiT
from dit_lightning.sampling import SamplingOptions, sample_latents
from tests.helpers import reg_reference as reg

pytestmark = pytest.mark.usefixtures("one_thread")

TINY: dict[str, Any] = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4)


def reg_sit() -> torch.nn.Module:
    """REG's SiT with every weight random (its zero-initialised output and adaLN layers too)."""
    torch.manual_seed(0)
    model = reg.SiT(**TINY, decoder_hidden_size=64, encoder_depth=1, z_dims=[32], projector_dim=48, qk_norm=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed" and not torch.count_nonzero(p):
                p.normal_(0, 0.3)
    return model.eval()


def our_dit(sd: dict) -> DiT:
    net = DiT(**TINY, num_classes=1000, learn_sigma=False, class_token_dim=32)
    load_dit_weights(net, reg_state_dict(sd))  # strictly: every name and shape
    return net.eval()


def test_reg_sit_loads_as_a_dit_with_the_same_outputs_in_our_time():
    ref = reg_sit()
    net = our_dit(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x, token = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 32, generator=g)
    t, y = torch.tensor([0.1, 0.5, 0.93]), torch.tensor([3, 999, 1000])
    with torch.no_grad():
        v_reg, _, token_v_reg = ref(x, t, y, cls_token=token)
        v, token_v = net(x, 1 - t, y, class_token=token)  # REG's time t is ours 1 - t; its velocity is -ours
    assert token_v_reg.abs().max() > 0.1 and v_reg.abs().max() > 0.1
    torch.testing.assert_close(v, -v_reg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(token_v, -token_v_reg, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls_cfg_scale", [3.0, 0.0])
def test_sde_euler_is_regs_euler_maruyama_sampler(cls_cfg_scale):
    ref = reg_sit()
    net = our_dit(ref.state_dict())
    n, steps = 3, 6
    y = torch.tensor([5, 17, 999])
    torch.manual_seed(7)
    latents, cls_latents = torch.randn(n, 4, 8, 8), torch.randn(n, 32)
    args = SimpleNamespace(cls_cfg_scale=cls_cfg_scale)
    # REG guides where guidance_low <= t <= guidance_high in its time: 0.7 is our [0.3, 1]; with 6 steps
    # its times are 1, 0.808, 0.616, 0.424, 0.232, 0.04: the first two steps unguided, the others guided
    torch.manual_seed(11)
    expected = reg.euler_maruyama_sampler(
        ref, latents, y, num_steps=steps, cfg_scale=2.5, guidance_high=0.7, cls_latents=cls_latents, args=args
    )
    torch.manual_seed(11)  # REG's draws, replayed: per step randn_like of the float64 latent, then of the token
    draws = [(torch.randn(n, 4, 8, 8, dtype=torch.float64), torch.randn(n, 32, dtype=torch.float64)) for _ in range(5)]

    def noise_fn(step: int, like: torch.Tensor) -> torch.Tensor:
        eps, cls_eps = draws[step]
        return torch.cat([eps.flatten(1), cls_eps], 1).to(like.dtype)

    ours = sample_latents(
        net, y, objective=FlowMatching(), noise=latents, class_token_noise=cls_latents, noise_fn=noise_fn,
        # the defaults of the last step (mean, 0.04) and of the diffusion (sigma, 1) are REG's
        options=SamplingOptions(sampler="sde-euler", num_steps=steps, cfg_scale=2.5, cfg_interval=(0.3, 1.0),
                                class_token_cfg_scale=cls_cfg_scale),
    )  # fmt: skip
    assert expected.abs().max() > 1
    torch.testing.assert_close(ours, expected.float(), rtol=0, atol=1e-5)
    # the token's guidance reaches the latents: another token scale, other samples
    other = sample_latents(
        net, y, objective=FlowMatching(), noise=latents, class_token_noise=cls_latents, noise_fn=noise_fn,
        sampler="sde-euler", num_steps=steps, cfg_scale=2.5, cfg_interval=(0.3, 1.0),
        class_token_cfg_scale=cls_cfg_scale + 1.5,
    )  # fmt: skip
    assert (other - ours).abs().max() > 1e-3


def test_every_flow_sampler_samples_a_class_token_dit_keyed_per_sample():
    torch.manual_seed(0)
    net = DiT(**TINY, num_classes=10, learn_sigma=False, class_token_dim=8).eval()
    with torch.no_grad():  # a token that matters: non-zero entry and exit
        net.final_layer.linear.weight.normal_(0, 0.05)
        net.final_layer.linear_cls.weight.normal_(0, 0.05)
        for block in net.blocks:
            block.adaLN_modulation[-1].weight.normal_(0, 0.05)
    flow = FlowMatching()
    y = torch.tensor([1, 2, 3])
    for sampler in ("ode-euler", "ode-heun", "ode-dopri5", "sde-heun"):
        x = sample_latents(net, y, objective=flow, sampler=sampler, num_steps=4, cfg_scale=2.0, seed=3)
        assert x.shape == (3, 4, 8, 8) and torch.isfinite(x).all(), sampler
    x = sample_latents(net, y, objective=flow, sampler="ode-euler", num_steps=4, cfg_scale=2.0, seed=3)
    # sample 2 alone, as index 2: the same sample (its latent and token noises keyed by (seed, index))
    alone = sample_latents(net, y[2:], [2], objective=flow, sampler="ode-euler", num_steps=4, cfg_scale=2.0, seed=3)
    torch.testing.assert_close(alone, x[2:], rtol=0, atol=1e-5)
    # the token's noise changes the latents
    token = torch.zeros(3, 8)
    zero_token = sample_latents(
        net, y, objective=flow, class_token_noise=token, sampler="ode-euler", num_steps=4, cfg_scale=2.0, seed=3
    )
    assert (zero_token - x).abs().max() > 1e-3
    # REG guides the token only where cfg_scale guides: scale 1, one conditional pass whatever the token's scale
    plain = sample_latents(net, y, objective=flow, sampler="ode-euler", num_steps=4, seed=3)
    token_only = sample_latents(
        net, y, objective=flow, sampler="ode-euler", num_steps=4, seed=3, class_token_cfg_scale=3.0
    )
    torch.testing.assert_close(token_only, plain, rtol=0, atol=0)
    assert (plain - x).abs().max() > 1e-3
    with pytest.raises(ValueError, match="class token.*flow samplers.*--objective flow"):
        sample_latents(net, y, sampler="ddim", num_steps=4)
    with pytest.raises(ValueError, match="guide_channels 3 does not apply.*class token"):
        sample_latents(net, y, objective=flow, sampler="ode-euler", num_steps=4, cfg_scale=2.0, guide_channels=3)
    with pytest.raises(ValueError, match="class_token_cfg_scale"):
        SamplingOptions(class_token_cfg_scale=-1.0)
