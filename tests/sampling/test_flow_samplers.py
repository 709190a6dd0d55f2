"""The flow samplers (FlowMatching.run_sampler, through sample_latents) against SiT's samplers
(tests/helpers/sit_reference.py: its drift, its torchdiffeq call, its SDE steps and last steps, its
doubled classifier-free-guidance batch) on a tiny random network, with the same keyed noise; and the
refusals of the other objective's samplers."""

import itertools

import pytest
import torch

from dit_lightning.diffusion import FlowMatching
from dit_lightning.sampling import SamplingOptions, initial_noise, sample_latents, step_noise
from tests.helpers import sit_reference as sit
from tests.helpers.models import random_dit

pytestmark = pytest.mark.usefixtures("one_thread")

PATHS = {"linear": "Linear", "gvp": "GVP", "vp": "VP"}
LABELS = torch.tensor([3, 7])
SEED = 5


def ours(net, flow, sampler, steps, cfg=1.0, guide=None, indices=None, labels=LABELS, **options):
    opts = SamplingOptions(sampler=sampler, num_steps=steps, cfg_scale=cfg, guide_channels=guide, seed=SEED, **options)
    return sample_latents(net, labels, indices, options=opts, objective=flow)


def theirs(net, path, prediction, run, cfg=1.0, guide=None):
    """``run(transport, z, model, randn, **model_kwargs)`` as SiT's sample.py calls its sampler: the
    doubled batch with the null class under guidance, its first half kept."""
    transport = sit.create_transport(PATHS[path], prediction)
    idx = torch.arange(len(LABELS))
    shape = (net.in_channels, net.input_size, net.input_size)
    z = initial_noise(idx, shape, SEED)
    forward = sit.sit_forward(net, net.learn_sigma)

    def randn(step, size):  # the keyed noise of the step (the null half's copy is never used)
        w = step_noise(idx, shape, SEED, step)
        return w if size[0] == len(idx) else torch.cat([w, w])

    with torch.no_grad():
        if cfg == 1.0:
            return run(transport, z, forward, randn, y=LABELS)
        model = sit.sit_forward_with_cfg(forward, guide)
        y = torch.cat([LABELS, torch.full_like(LABELS, net.num_classes)])
        return run(transport, torch.cat([z, z]), model, randn, y=y, cfg_scale=cfg)[: len(LABELS)]


def ode(method, steps):
    return lambda tr, z, model, randn, **kw: sit.sample_ode(tr, z, model, sampling_method=method, num_steps=steps, **kw)


def sde(method, steps, **settings):
    return lambda tr, z, model, randn, **kw: sit.sample_sde(
        tr, z, model, randn, sampling_method=method, num_steps=steps, **settings, **kw
    )


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path,prediction", list(itertools.product(PATHS, ["velocity", "noise", "score"])))
def test_ode_euler_matches_sit_for_every_path_and_prediction(path, prediction):
    net = random_dit(seed=1)
    flow = FlowMatching(path_type=path, prediction=prediction)
    close(ours(net, flow, "ode-euler", 4), theirs(net, path, prediction, ode("euler", 4)))


@pytest.mark.parametrize("path,prediction", [("linear", "velocity"), ("gvp", "noise"), ("vp", "score")])
def test_ode_heun_matches_sits_heun2(path, prediction):
    net = random_dit(seed=2)
    flow = FlowMatching(path_type=path, prediction=prediction)
    close(ours(net, flow, "ode-heun", 4), theirs(net, path, prediction, ode("heun2", 4)))


def test_ode_dopri5_matches_sit_with_guidance():
    net = random_dit(seed=3, learn_sigma=False)  # 4 output channels
    flow = FlowMatching()
    close(ours(net, flow, "ode-dopri5", 3), theirs(net, "linear", "velocity", ode("dopri5", 3)))
    # guidance on every channel: SiT's doubled state has two equal halves, so dopri5 takes the same steps
    close(
        ours(net, flow, "ode-dopri5", 3, cfg=4.0, atol=1e-4, rtol=1e-2),
        theirs(
            net,
            "linear",
            "velocity",
            lambda *a, **k: sit.sample_ode(*a[:3], num_steps=3, atol=1e-4, rtol=1e-2, **k),
            cfg=4.0,
        ),
    )


@pytest.mark.parametrize(
    "sampler,last", list(itertools.product(["euler", "heun"], ["mean", "tweedie", "euler", "none"]))
)
def test_sde_samplers_and_last_steps_match_sit(sampler, last):
    net = random_dit(seed=4)
    flow = FlowMatching()
    sit_last = {"mean": "Mean", "tweedie": "Tweedie", "euler": "Euler", "none": None}[last]
    if (sampler, last) == ("heun", "none"):  # its last Heun step evaluates the score at t = 1: NaN in SiT
        with pytest.raises(ValueError, match="sde-heun without a last step"):
            ours(net, flow, "sde-heun", 5, last_step="none")
        return
    expected = theirs(net, "linear", "velocity", sde(sampler.capitalize(), 5, last_step=sit_last, last_step_size=0.1))
    close(ours(net, flow, f"sde-{sampler}", 5, last_step=last, last_step_size=0.1), expected)


@pytest.mark.parametrize(
    "path,prediction,form", [("gvp", "noise", "sbdm"), ("vp", "score", "linear"), ("linear", "noise", "decreasing")]
)
def test_sde_diffusion_forms_match_sit(path, prediction, form):
    net = random_dit(seed=5)
    flow = FlowMatching(path_type=path, prediction=prediction)
    sit_form = "SBDM" if form == "sbdm" else form
    expected = theirs(net, path, prediction, sde("Euler", 4, diffusion_form=sit_form, diffusion_norm=0.5))
    close(ours(net, flow, "sde-euler", 4, diffusion_form=form, diffusion_norm=0.5), expected)


@pytest.mark.parametrize("guide", [3, None])
def test_guidance_is_sits(guide):
    """SiT's forward_with_cfg on its doubled batch (3 channels: its default) = the guided model here."""
    net = random_dit(seed=6)  # 8 output channels: SiT's learn_sigma layout
    flow = FlowMatching()
    close(
        ours(net, flow, "ode-euler", 4, cfg=4.0, guide=guide),
        theirs(net, "linear", "velocity", ode("euler", 4), 4.0, guide),
    )
    close(
        ours(net, flow, "sde-euler", 4, cfg=4.0, guide=guide),
        theirs(net, "linear", "velocity", sde("Euler", 4), 4.0, guide),
    )


def test_sample_i_does_not_depend_on_the_batch():
    net = random_dit(seed=7)
    flow = FlowMatching()
    both = ours(net, flow, "sde-euler", 4, indices=[4, 9], labels=torch.tensor([1, 2]))
    alone = ours(net, flow, "sde-euler", 4, indices=[9], labels=torch.tensor([2]))
    close(both[1:], alone)


def test_each_objective_refuses_the_others_samplers():
    net = random_dit(seed=8)
    with pytest.raises(ValueError, match="does not sample a model trained with objective ddpm.*use ddpm, ddim"):
        ours(net, None, "ode-euler", 4)
    for sampler in ("ddpm", "ddim", "dpm++2m"):
        with pytest.raises(ValueError, match="trained with objective flow .*use ode-euler"):
            ours(net, FlowMatching(), sampler, 4)
    with pytest.raises(ValueError, match="eta"):
        ours(net, FlowMatching(), "ode-euler", 4, eta=1.0)
    with pytest.raises(ValueError, match="at least 2"):
        ours(net, FlowMatching(), "ode-euler", 1)
    with pytest.raises(ValueError, match="sbdm"):
        ours(net, FlowMatching(), "sde-euler", 4, diffusion_form="sbdm")  # diverges at t = 0 (NaN in SiT)


def test_sde_heun_without_a_last_step_on_gvp_samples_as_sit():
    """On the GVP path sigma(1) = cos(pi / 2) is not exactly 0 in floating point: SiT's stochastic Heun
    without a last step gives finite samples there, and so does this one (the linear path is refused)."""
    net = random_dit(seed=9)
    flow = FlowMatching(path_type="gvp")
    expected = theirs(net, "gvp", "velocity", sde("Heun", 5, last_step=None))
    got = ours(net, flow, "sde-heun", 5, last_step="none")
    assert torch.isfinite(got).all()
    close(got, expected)


def test_timestep_shift_and_cfg_interval_match_lightningdit():
    """LightningDiT's inference path (tests/helpers/lightningdit_transport_reference.py): euler ODE on their
    shifted grid, forward_with_cfg with cfg_interval True (guidance only for t >= cfg_interval_start, on the
    first 3 channels), the doubled batch's first half kept; ours: timestep_shift, cfg_interval [start, 1],
    guide_channels 3. The grid of 8 times shifted by 0.3 has 3 times below 0.11 (0, 0.048, 0.107)."""
    from functools import partial

    from tests.helpers import lightningdit_transport_reference as ldit

    net = random_dit(seed=10, learn_sigma=False)  # LightningDiT's velocity network: C outputs
    idx = torch.arange(len(LABELS))
    z = initial_noise(idx, (net.in_channels, net.input_size, net.input_size), SEED)
    sample_fn = ldit.Sampler(ldit.create_transport("Linear", "velocity", None, None, None)).sample_ode(
        sampling_method="euler", num_steps=8, atol=1e-6, rtol=1e-3, reverse=False, timestep_shift=0.3
    )
    y = torch.cat([LABELS, torch.full_like(LABELS, net.num_classes)])
    kwargs = dict(y=y, cfg_scale=4.0, cfg_interval=True, cfg_interval_start=0.11)
    with torch.no_grad():
        expected = sample_fn(torch.cat([z, z]), partial(ldit.forward_with_cfg, net.forward), **kwargs)[-1][:2]
    options = dict(guide=3, timestep_shift=0.3)
    got = ours(net, FlowMatching(), "ode-euler", 8, cfg=4.0, cfg_interval=(0.11, 1.0), **options)
    close(got, expected)
    # each setting changes the samples: neither is a no-op
    assert not torch.allclose(ours(net, FlowMatching(), "ode-euler", 8, cfg=4.0, **options), expected, atol=1e-4)
    unshifted = ours(net, FlowMatching(), "ode-euler", 8, cfg=4.0, guide=3, cfg_interval=(0.11, 1.0))
    assert not torch.allclose(unshifted, expected, atol=1e-4)


def test_flow_sampling_extras_are_refused_where_they_mean_nothing():
    net = random_dit(seed=11)
    with pytest.raises(ValueError, match="flow times 0 <= lo <= hi <= 1"):
        ours(net, FlowMatching(), "ode-euler", 4, cfg=2.0, cfg_interval=(200, 700))  # DDPM timesteps
    with pytest.raises(ValueError, match="sde-euler has none"):
        ours(net, FlowMatching(), "sde-euler", 4, timestep_shift=0.3)
    with pytest.raises(ValueError, match="give s > 0"):
        SamplingOptions(timestep_shift=-1.0)
