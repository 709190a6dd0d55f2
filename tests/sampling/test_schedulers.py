"""The fast samplers: diffusers' schedulers built from the model's betas, stepped with guidance,
keyed noise and x0 clamping. Checked against diffusers' own classes (the schedulers stepped by
hand, ``DiTPipeline``), not against a re-implementation."""

import pytest
import torch
from diffusers import DDPMScheduler, DPMSolverMultistepScheduler

from dit_lightning.diffusion import DDPMObjective, get_named_beta_schedule
from dit_lightning.images import make_grid_image
from dit_lightning.sampling import (
    DIFFUSERS_SAMPLERS,
    build_scheduler,
    guided_model_fn,
    initial_noise,
    noise_schedule_of,
    sample_latents,
    scheduler_config,
)
from tests.helpers.models import random_dit
from tests.sampling.test_loop import _noisy_oracle

pytestmark = pytest.mark.usefixtures("one_thread")

STOCHASTIC = ["euler-a", "dpm++2m-sde", "diffusers-ddpm"]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("steps", [1000, 250])
def test_scheduler_betas_are_the_models_own(schedule, steps):
    config = scheduler_config(schedule, steps)
    ours = torch.from_numpy(get_named_beta_schedule(schedule, steps))
    for sampler in DIFFUSERS_SAMPLERS:
        betas = build_scheduler(sampler, schedule, steps).betas.double()
        torch.testing.assert_close(betas, ours, rtol=2e-6, atol=1e-9)  # diffusers keeps float32
    assert noise_schedule_of(config) == (schedule, steps)
    assert noise_schedule_of({"beta_schedule": "scaled_linear"}) is None


@pytest.mark.parametrize("sampler", sorted(DIFFUSERS_SAMPLERS))
def test_every_sampler_is_keyed_per_sample_and_guided(sampler):
    net = random_dit()
    y, idx = torch.tensor([3, 1, 4, 1]), torch.arange(20, 24)
    kw = dict(sampler=sampler, num_steps=5, cfg_scale=3.0, seed=7)
    whole = sample_latents(net, y, idx, **kw)
    assert whole.shape == (4, 4, 8, 8) and torch.isfinite(whole).all()
    parts = torch.cat([sample_latents(net, y[:1], idx[:1], **kw), sample_latents(net, y[1:], idx[1:], **kw)])
    torch.testing.assert_close(whole, parts, rtol=1e-5, atol=1e-5)
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(sample_latents(net, y[perm], idx[perm], **kw), whole[perm], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(whole, sample_latents(net, y, idx, **{**kw, "seed": 8}))  # x_T is keyed
    assert not torch.allclose(whole, sample_latents(net, y, idx, **{**kw, "cfg_scale": 1.0}))


@pytest.mark.parametrize("sampler", STOCHASTIC)
def test_stochastic_samplers_draw_keyed_noise_at_every_step(sampler):
    """Same x_T, other step noise (another seed with x_T fixed): a different sample."""
    net, y = random_dit(), torch.tensor([1, 2])
    z = initial_noise(torch.arange(2), (4, 8, 8), 0)
    a = sample_latents(net, y, sampler=sampler, num_steps=4, noise=z, seed=0)
    assert torch.equal(a, sample_latents(net, y, sampler=sampler, num_steps=4, noise=z, seed=0))
    assert not torch.allclose(a, sample_latents(net, y, sampler=sampler, num_steps=4, noise=z, seed=1))


def test_dpm_solver_loop_is_diffusers_stepped_by_hand_with_forward_with_cfg():
    """The loop is exactly: DPMSolverMultistepScheduler (our betas) stepped with the epsilon of
    DiT.forward_with_cfg on the doubled batch, from the keyed x_T."""
    net, y = random_dit(), torch.tensor([5, 0, 9])
    ours = sample_latents(net, y, sampler="dpm++2m", num_steps=7, cfg_scale=2.5, seed=3)
    sched = DPMSolverMultistepScheduler(
        beta_schedule="linear", beta_start=1e-4, beta_end=0.02, algorithm_type="dpmsolver++", solver_order=2
    )
    sched.set_timesteps(7)
    x = initial_noise(torch.arange(3), (4, 8, 8), 3)
    null = torch.full_like(y, 10)
    with torch.no_grad():
        for t in sched.timesteps:
            tt = torch.full((6,), int(t))
            out = net.forward_with_cfg(torch.cat([x, x]), tt, torch.cat([y, null]), 2.5)[:3]
            x = sched.step(out[:, :4], t, x).prev_sample
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)


def test_diffusers_ddpm_uses_the_learned_variance_and_the_models_betas():
    net, y = random_dit(), torch.tensor([2, 6])
    sched = build_scheduler("diffusers-ddpm", learn_sigma=True)
    assert isinstance(sched, DDPMScheduler) and sched.config.variance_type == "learned_range"
    assert build_scheduler("diffusers-ddpm", learn_sigma=False).config.variance_type == "fixed_small"
    a = sample_latents(net, y, sampler="diffusers-ddpm", num_steps=6)
    fixed = random_dit(learn_sigma=False)
    b = sample_latents(fixed, y, sampler="diffusers-ddpm", num_steps=6)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()


@pytest.mark.parametrize("sampler", ["dpm++2m", "unipc", "euler", "diffusers-ddim"])
def test_clip_denoised_keeps_cosine_pixel_sampling_in_range(sampler):
    """As for DDPM/DDIM (tests/sampling/test_loop.py): with the x0 estimate clamped through
    epsilon, the first step at t = 999 of the cosine schedule (acp 2.4e-9) no longer throws the
    inputs of the next network call hundreds of standard deviations out."""
    net = random_dit(in_channels=1)
    data = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 - 1
    y = torch.zeros(4, dtype=torch.long)
    kw = dict(sampler=sampler, num_steps=10, objective=DDPMObjective(noise_schedule="cosine"), seed=3)
    seen: list[float] = []
    out = sample_latents(net, y, model_fn=_noisy_oracle(data, "cosine", 0.02, seen), clip_denoised=True, **kw)
    assert max(seen[1:]) < 6.0 and out.abs().max() <= 1.0 + 1e-4
    seen.clear()
    sample_latents(net, y, model_fn=_noisy_oracle(data, "cosine", 0.02, seen), clip_denoised=False, **kw)
    assert max(seen[1:]) > 20.0


def test_unknown_sampler_and_misplaced_eta_are_refused():
    net, y = random_dit(), torch.tensor([1])
    with pytest.raises(ValueError, match="unknown sampler 'dpm'.*dpm\\+\\+2m"):
        sample_latents(net, y, sampler="dpm", num_steps=4)
    with pytest.raises(ValueError, match="eta=0.5 is a DDIM setting"):
        sample_latents(net, y, sampler="unipc", num_steps=4, eta=0.5)
    assert torch.isfinite(sample_latents(net, y, sampler="diffusers-ddim", num_steps=4, eta=0.5)).all()
    with pytest.raises(ValueError, match="cannot clamp x0"):
        build_scheduler("euler", thresholding=True)


def test_module_sample_and_the_guided_model_take_the_new_samplers():
    from dit_lightning.module import DiTModule
    from tests.helpers.training import TINY_MODULE

    module = DiTModule(**TINY_MODULE, sampler="unipc", sample_steps=5).eval()
    a = module.sample([1, 2], seed=2)
    b = sample_latents(module.ema, [1, 2], sampler="unipc", num_steps=5, seed=2, clip_denoised=True)
    torch.testing.assert_close(a, b)
    # the sample-grid callback passes its sampler through DiTModule.sample
    from types import SimpleNamespace

    from dit_lightning.callbacks import SampleGrid

    trainer = SimpleNamespace(is_global_zero=True, loggers=[], global_step=0)
    grid = SampleGrid(classes=[1, 2], per_class=2, num_steps=3, sampler="euler-a").render(trainer, module)
    expect = make_grid_image(module.decode(module.sample([1, 1, 2, 2], num_steps=3, sampler="euler-a")), nrow=2)
    assert torch.equal(grid, expect)
    assert not torch.equal(grid, make_grid_image(module.decode(module.sample([1, 1, 2, 2], num_steps=3)), nrow=2))
    # Euler's timesteps are fractional: the DiT embeds them like integer ones
    out = guided_model_fn(module.ema, 2.0)(torch.zeros(1, 1, 8, 8), torch.tensor([3.5]), torch.tensor([1]))
    assert out.shape == (1, 2, 8, 8) and torch.isfinite(out).all()
