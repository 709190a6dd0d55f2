"""The sampling loop: keyed per-sample determinism, classifier-free guidance, DDPM / DDIM
against the diffusion's own loops, autocast, and x_0 clamping for pixel stores. Tiny models
(8x8 latents, a few thousand parameters), few steps."""

import pytest
import torch

from dit_lightning.diffusion import DDPMObjective, create_diffusion
from dit_lightning.sampling import guided_model_fn, initial_noise, sample_latents
from tests.helpers.models import random_dit

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ddim_eta0_matches_the_diffusion_loop_and_is_deterministic():
    net, y = random_dit(), torch.tensor([1, 2, 3])
    a = sample_latents(net, y, sampler="ddim", num_steps=8, cfg_scale=2.0, seed=5)
    b = sample_latents(net, y, sampler="ddim", num_steps=8, cfg_scale=2.0, seed=5)
    assert torch.equal(a, b)
    z = initial_noise(torch.arange(3), (4, 8, 8), 5)
    ref = (
        DDPMObjective()
        .respaced("ddim", 8, learn_sigma=True)
        .ddim_sample_loop(guided_model_fn(net, 2.0), z.shape, noise=z, model_kwargs={"y": y})
    )
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)
    # eta > 0 draws keyed noise: deterministic per seed, different from eta 0
    c = sample_latents(net, y, sampler="ddim", num_steps=8, eta=1.0, seed=5)
    assert torch.equal(c, sample_latents(net, y, sampler="ddim", num_steps=8, eta=1.0, seed=5))
    assert not torch.allclose(c, sample_latents(net, y, sampler="ddim", num_steps=8, seed=5))


def test_ddpm_step_matches_the_diffusion_p_sample_loop():
    """With the per-step noise replayed from a generator, the keyed loop is p_sample_loop."""
    net, y = random_dit(), torch.tensor([0, 9])
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 4, 8, 8, generator=g)
    ours = sample_latents(net, y, num_steps=7, noise=z, noise_fn=lambda step, x: torch.randn(x.shape, generator=g))
    g = torch.Generator().manual_seed(3)
    ref = (
        DDPMObjective()
        .respaced("ddpm", 7, learn_sigma=True)
        .p_sample_loop(net.forward, (2, 4, 8, 8), model_kwargs={"y": y}, generator=g)
    )
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_sample_i_does_not_depend_on_the_batch(sampler):
    net = random_dit()
    y, idx = torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(10, 16)
    kw = dict(sampler=sampler, eta=0.5, num_steps=6, cfg_scale=3.0, seed=11)
    whole = sample_latents(net, y, idx, **kw)
    parts = torch.cat([sample_latents(net, y[:1], idx[:1], **kw), sample_latents(net, y[1:], idx[1:], **kw)])
    torch.testing.assert_close(whole, parts, rtol=1e-5, atol=1e-5)
    perm = torch.tensor([5, 0, 3, 1, 4, 2])
    torch.testing.assert_close(sample_latents(net, y[perm], idx[perm], **kw), whole[perm], rtol=1e-5, atol=1e-5)
    other_seed = sample_latents(net, y, idx, **{**kw, "seed": 12})
    assert not torch.allclose(whole, other_seed)


def test_cfg_scale_one_equals_conditional_sampling():
    net, y = random_dit(), torch.tensor([2, 7, 7])
    cond = sample_latents(net, y, num_steps=6, cfg_scale=1.0)
    doubled = sample_latents(net, y, num_steps=6, model_fn=guided_model_fn(net, 1.0, force_cfg=True))
    torch.testing.assert_close(cond, doubled, rtol=1e-5, atol=1e-5)
    guided = sample_latents(net, y, num_steps=6, cfg_scale=4.0)
    three = sample_latents(net, y, num_steps=6, cfg_scale=4.0, guide_channels=3)
    assert not torch.allclose(cond, guided) and not torch.allclose(guided, three)
    # the reference's 3-channel mode leaves the 4th epsilon channel conditional
    x, t = torch.randn(3, 4, 8, 8), torch.full((3,), 500)
    out = guided_model_fn(net, 4.0, guide_channels=3)(x, t, y)
    torch.testing.assert_close(out[:, 3:], net(x, t, y)[:, 3:], rtol=1e-5, atol=1e-5)


def test_bf16_autocast_runs_and_stays_close():
    net, y = random_dit(), torch.tensor([1, 2])
    a = sample_latents(net, y, sampler="ddim", num_steps=4)
    b = sample_latents(net, y, sampler="ddim", num_steps=4, precision="bf16")
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.1 * a.abs().max()


# --------------------------------------------------------------------------------------
# Pixel stores: x_0 estimates clamped to [-1, 1]
# --------------------------------------------------------------------------------------


def _noisy_oracle(data, schedule, error, seen):
    """epsilon of the exact posterior mean E[x0 | x_t] over the images ``data`` (in [-1, 1]),
    plus a fixed error of size ``error`` (what a trained network adds); records max |x_t| of
    every call, i.e. how far the inputs the network would see are from the training marginals."""
    acp = torch.tensor(create_diffusion(noise_schedule=schedule).alphas_cumprod, dtype=torch.float64)
    offset = error * torch.randn(data.shape[1:], generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def fn(x, t, y):
        seen.append(x.abs().max().item())
        xd, a = x.double(), acp[t.long()].view(-1, 1, 1, 1)
        d2 = ((xd[:, None] - a[:, None].sqrt() * data[None]) ** 2).flatten(2).sum(-1)  # (N, K)
        w = torch.softmax(-d2 / (2 * (1 - a.view(-1, 1))), dim=1)
        x0 = torch.einsum("nk,kchw->nchw", w, data)
        eps = (xd - a.sqrt() * x0) / (1 - a).sqrt() + offset
        return torch.cat([eps, torch.zeros_like(eps)], 1).to(x.dtype)

    return fn


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_clip_denoised_keeps_cosine_pixel_sampling_in_range(sampler):
    """The cosine schedule's last step has alphas_cumprod ~ 2.4e-9 (beta capped at 0.999): x_0 =
    (x_T - sqrt(1 - acp) eps) / sqrt(acp) multiplies an epsilon error of 0.02 by ~2e4. Unclamped,
    a respaced DDPM that starts at t = 999 hands the network inputs hundreds of standard deviations
    out (what saturated the digits); clamped to the pixel range, every input stays on the forward
    process's scale and the images in [-1, 1]."""
    net = random_dit(in_channels=1)  # only fixes the shape and device; model_fn replaces it
    data = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 - 1
    y = torch.zeros(4, dtype=torch.long)
    kw = dict(sampler=sampler, num_steps=10, objective=DDPMObjective(noise_schedule="cosine"), seed=3)
    if sampler == "ddim":
        kw["num_steps"] = 37  # no integer stride gives 37 steps: section respacing, t = 999 as DDPM
    assert 999 in DDPMObjective(noise_schedule="cosine").respaced(sampler, kw["num_steps"], True).timestep_map

    seen: list[float] = []
    out = sample_latents(net, y, model_fn=_noisy_oracle(data, "cosine", 0.02, seen), clip_denoised=True, **kw)
    assert max(seen) < 6.0  # |sqrt(acp) x0 + sqrt(1 - acp) z| for |x0| <= 1 and 64 draws of z per image
    assert out.abs().max() <= 1.0 + 1e-4

    # The same sampler unclamped: the second input is already far outside anything trained on.
    seen.clear()
    sample_latents(net, y, model_fn=_noisy_oracle(data, "cosine", 0.02, seen), clip_denoised=False, **kw)
    assert seen[1] > 20.0


def test_on_step_counts_network_evaluations_and_step_lines_print_them(capsys):
    from dit_lightning.sampling import StepLines

    seen: list[int] = []
    sample_latents(random_dit(), [1, 2], sampler="ddim", num_steps=5, on_step=seen.append)
    assert seen == [1, 2, 3, 4, 5]
    lines = StepLines("predict batch 0", every_s=0.0)
    sample_latents(random_dit(), [1], sampler="ddim", num_steps=3, on_step=lines)
    assert capsys.readouterr().err.splitlines()[-1] == "predict batch 0: 3 network evaluations so far"
