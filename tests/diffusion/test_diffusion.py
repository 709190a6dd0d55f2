"""Gaussian diffusion: schedules, closed forms, hybrid loss, respacing and samplers.

Every check is against a value computed independently here (numpy float64 from the
betas, the exact normal CDF, torch.distributions), on tensors of a few elements.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dit_lightning.diffusion import (
    GaussianDiffusion,
    SpacedDiffusion,
    approx_standard_normal_cdf,
    create_diffusion,
    discretized_gaussian_log_likelihood,
    get_named_beta_schedule,
    mean_flat,
    normal_kl,
    space_timesteps,
)

SHAPE = (2, 1, 2, 2)  # N, C, H, W: the whole file runs on tensors this small


def _acp(betas: np.ndarray, t: int) -> float:
    """alpha_cumprod by an explicit loop, independent of np.cumprod in the implementation."""
    out = 1.0
    for b in betas[: t + 1]:
        out *= 1.0 - b
    return out


def _tanh_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


# --------------------------------------------------------------------------------------
# Schedules and tables
# --------------------------------------------------------------------------------------


def test_linear_schedule_endpoints_and_dtype():
    d = create_diffusion()
    assert d.num_timesteps == 1000
    assert d.betas.dtype == np.float64
    assert d.betas[0] == pytest.approx(1e-4, abs=1e-15)
    assert d.betas[-1] == pytest.approx(0.02, abs=1e-15)
    assert np.allclose(np.diff(d.betas), (0.02 - 1e-4) / 999)
    # Scaled for other step counts: 4x the betas for 250 steps.
    b250 = get_named_beta_schedule("linear", 250)
    assert b250[0] == pytest.approx(4e-4) and b250[-1] == pytest.approx(0.08)
    for name in ("alphas_cumprod", "alphas_cumprod_prev", "posterior_variance", "posterior_log_variance_clipped"):
        assert getattr(d, name).dtype == np.float64


def test_alphas_cumprod_monotone_and_prev():
    d = create_diffusion()
    acp = d.alphas_cumprod
    assert (np.diff(acp) < 0).all() and 0 < acp[-1] < acp[0] < 1
    assert d.alphas_cumprod_prev[0] == 1.0
    assert np.array_equal(d.alphas_cumprod_prev[1:], acp[:-1])
    assert acp[500] == pytest.approx(_acp(d.betas, 500), rel=1e-12)


@pytest.mark.parametrize("t", [1, 2, 500, 999])
def test_posterior_variance_closed_form(t):
    d = create_diffusion()
    b = d.betas
    expected = b[t] * (1.0 - _acp(b, t - 1)) / (1.0 - _acp(b, t))
    assert d.posterior_variance[t] == pytest.approx(expected, rel=1e-10)
    assert d.posterior_log_variance_clipped[t] == pytest.approx(math.log(expected), rel=1e-10)
    coef1 = b[t] * math.sqrt(_acp(b, t - 1)) / (1.0 - _acp(b, t))
    coef2 = (1.0 - _acp(b, t - 1)) * math.sqrt(1.0 - b[t]) / (1.0 - _acp(b, t))
    assert d.posterior_mean_coef1[t] == pytest.approx(coef1, rel=1e-10)
    assert d.posterior_mean_coef2[t] == pytest.approx(coef2, rel=1e-10)


def test_posterior_log_variance_clipped_at_zero():
    d = create_diffusion()
    assert d.posterior_variance[0] == 0.0
    assert d.posterior_log_variance_clipped[0] == d.posterior_log_variance_clipped[1]
    assert np.isfinite(d.posterior_log_variance_clipped).all()


def test_cosine_schedule():
    betas = get_named_beta_schedule("cosine", 1000)
    assert betas.dtype == np.float64 and betas.max() <= 0.999 and betas.min() > 0
    f = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    # Uncapped steps follow alpha_bar exactly.
    assert _acp(betas, 499) == pytest.approx(f(0.5) / f(0.0), rel=1e-9)
    with pytest.raises(ValueError):
        get_named_beta_schedule("quadratic", 10)


def test_table_lookup_dtype_device_and_broadcast():
    d = create_diffusion()
    x = torch.zeros(3, 2, 4, 4, dtype=torch.float32)
    t = torch.tensor([0, 10, 999])
    out = d._extract("alphas_cumprod", t, x)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.allclose(out[:, 1, 2, 3], torch.tensor(d.alphas_cumprod[[0, 10, 999]], dtype=torch.float32))
    assert d._extract("betas", t, x.double()).dtype == torch.float64


# --------------------------------------------------------------------------------------
# KL and the discretized decoder
# --------------------------------------------------------------------------------------


def test_normal_kl_known_values():
    # KL(N(0,1) || N(1,4)) = log(2) + (1 + 1) / (2 * 4) - 1/2
    kl = normal_kl(torch.tensor(0.0), 0.0, 1.0, math.log(4.0))
    assert kl.item() == pytest.approx(math.log(2.0) - 0.25, rel=1e-6)
    m, lv = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    assert torch.allclose(normal_kl(m, lv, m, lv), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    m2, lv2 = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(m, torch.exp(0.5 * lv)), torch.distributions.Normal(m2, torch.exp(0.5 * lv2))
    )
    assert torch.allclose(normal_kl(m, lv, m2, lv2), ref, rtol=1e-10)


def test_approx_cdf_close_to_exact():
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    assert (approx_standard_normal_cdf(x) - torch.special.ndtr(x)).abs().max() < 3e-4


def test_discretized_log_likelihood_matches_exact_cdf():
    g = torch.Generator().manual_seed(1)
    x = torch.linspace(-0.98, 0.98, 16, dtype=torch.float64)
    scale = 0.01 + 0.04 * torch.rand(16, generator=g, dtype=torch.float64)
    means = x + scale * torch.randn(16, generator=g, dtype=torch.float64)
    ll = discretized_gaussian_log_likelihood(x, means=means, log_scales=torch.log(scale))
    exact = torch.log(
        torch.special.ndtr((x - means + 1 / 255) / scale) - torch.special.ndtr((x - means - 1 / 255) / scale)
    )
    # Each CDF is off by < 3e-4, so the bin probability by < 6e-4; likely bins agree in log too.
    assert (torch.exp(ll) - torch.exp(exact)).abs().max() < 6e-4
    likely = exact > math.log(0.05)
    assert likely.sum() >= 8 and torch.allclose(ll[likely], exact[likely], atol=5e-3)
    # The tanh approximation is what is used, exactly.
    c = (x - means).numpy()
    s = scale.numpy()
    hand = np.log(_tanh_cdf((c + 1 / 255) / s) - _tanh_cdf((c - 1 / 255) / s))
    assert np.allclose(ll.numpy(), hand, rtol=1e-12)


def test_discretized_log_likelihood_edges():
    scale = torch.tensor([0.3, 0.3], dtype=torch.float64)
    means = torch.tensor([-0.9, 0.9], dtype=torch.float64)
    x = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    ll = discretized_gaussian_log_likelihood(x, means=means, log_scales=torch.log(scale))
    low = torch.log(torch.special.ndtr((x[0] - means[0] + 1 / 255) / scale[0]))
    high = torch.log(1 - torch.special.ndtr((x[1] - means[1] - 1 / 255) / scale[1]))
    assert torch.allclose(torch.exp(ll), torch.exp(torch.stack([low, high])), atol=3e-4)
    # With the tails given to the end levels, the 256 levels are a distribution.
    levels = torch.linspace(-1, 1, 256, dtype=torch.float64)
    for mean, log_scale in [(0.0, math.log(0.5)), (0.97, math.log(0.05)), (-1.3, math.log(0.2))]:
        lp = discretized_gaussian_log_likelihood(
            levels, means=torch.full_like(levels, mean), log_scales=torch.full_like(levels, log_scale)
        )
        assert torch.exp(lp).sum().item() == pytest.approx(1.0, abs=1e-9)
    with pytest.raises(ValueError):
        discretized_gaussian_log_likelihood(x, means=means[:1], log_scales=scale)


# --------------------------------------------------------------------------------------
# Forward process
# --------------------------------------------------------------------------------------


def test_q_sample_exact_with_noise():
    d = create_diffusion()
    x0 = torch.randn(SHAPE, dtype=torch.float64)
    noise = torch.randn(SHAPE, dtype=torch.float64)
    t = torch.tensor([3, 700])
    xt = d.q_sample(x0, t, noise=noise)
    for i, ti in enumerate(t.tolist()):
        a = _acp(d.betas, ti)
        assert torch.allclose(xt[i], math.sqrt(a) * x0[i] + math.sqrt(1 - a) * noise[i], rtol=1e-12)
    mean, var, log_var = d.q_mean_variance(x0, t)
    assert torch.allclose(var[1], torch.full_like(var[1], 1 - _acp(d.betas, 700)))
    assert torch.allclose(log_var, torch.log(var))


def test_q_sample_statistics():
    d = create_diffusion()
    n, t = 20000, 300
    x0 = torch.full((n, 1), 0.5)
    xt = d.q_sample(x0, torch.full((n,), t))
    a = _acp(d.betas, t)
    assert xt.mean().item() == pytest.approx(0.5 * math.sqrt(a), abs=0.03)
    assert xt.var().item() == pytest.approx(1 - a, abs=0.03)


def test_sample_timesteps_range_and_seed():
    d = create_diffusion("10")
    t = d.sample_timesteps(500, "cpu", torch.Generator().manual_seed(0))
    assert t.dtype == torch.long and t.min() >= 0 and t.max() < 10 and len(set(t.tolist())) == 10
    assert torch.equal(t, d.sample_timesteps(500, "cpu", torch.Generator().manual_seed(0)))


def test_predict_xstart_eps_roundtrip():
    d = create_diffusion()
    x0, eps = torch.randn(SHAPE, dtype=torch.float64), torch.randn(SHAPE, dtype=torch.float64)
    t = torch.tensor([0, 999])
    xt = d.q_sample(x0, t, noise=eps)
    assert torch.allclose(d._predict_xstart_from_eps(xt, t, eps), x0, atol=1e-9)
    assert torch.allclose(d._predict_eps_from_xstart(xt, t, x0), eps, atol=1e-9)


# --------------------------------------------------------------------------------------
# Training loss
# --------------------------------------------------------------------------------------


def _hand_vb_bits(d: GaussianDiffusion, x0, noise, eps_hat, v, t: int) -> float:
    """The hybrid loss's VLB term for one sample, from the betas alone (numpy float64)."""
    b = d.betas
    a, a_prev = _acp(b, t), (_acp(b, t - 1) if t > 0 else 1.0)
    xt = math.sqrt(a) * x0 + math.sqrt(1 - a) * noise
    pred_x0 = (xt - math.sqrt(1 - a) * eps_hat) / math.sqrt(a)
    c1 = b[t] * math.sqrt(a_prev) / (1 - a)
    c2 = (1 - a_prev) * math.sqrt(1 - b[t]) / (1 - a)
    model_mean = c1 * pred_x0 + c2 * xt
    pv = lambda s: b[s] * (1 - _acp(b, s - 1)) / (1 - _acp(b, s))  # noqa: E731
    min_log = math.log(pv(max(t, 1)))
    frac = (v + 1) / 2
    model_log_var = frac * math.log(b[t]) + (1 - frac) * min_log
    if t == 0:
        s = np.exp(0.5 * model_log_var)
        c = x0 - model_mean
        cdf_plus, cdf_min = _tanh_cdf((c + 1 / 255) / s), _tanh_cdf((c - 1 / 255) / s)
        lp = np.where(
            x0 < -0.999, np.log(cdf_plus), np.where(x0 > 0.999, np.log(1 - cdf_min), np.log(cdf_plus - cdf_min))
        )
        return float(-lp.mean() / math.log(2))
    true_mean = c1 * x0 + c2 * xt
    true_log_var = min_log
    kl = 0.5 * (
        -1
        + model_log_var
        - true_log_var
        + np.exp(true_log_var - model_log_var)
        + (true_mean - model_mean) ** 2 * np.exp(-model_log_var)
    )
    return float(kl.mean() / math.log(2))


def test_training_losses_hand_values_and_gradients():
    d = create_diffusion()
    x0 = torch.tensor([[[[-1.0, -0.3], [0.4, 1.0]]], [[[0.2, -0.7], [0.9, -0.1]]]], dtype=torch.float64)
    noise = torch.randn(SHAPE, dtype=torch.float64)
    eps_hat = (noise + torch.tensor([0.1, -0.2, 0.05, 0.3], dtype=torch.float64).view(1, 1, 2, 2)).requires_grad_()
    v = torch.tensor([[0.3, -0.5, 0.9, 0.0], [-0.2, 0.6, 0.1, -0.8]], dtype=torch.float64).view(SHAPE).requires_grad_()
    seen = []

    def model_fn(x, t, y):
        seen.append((t.clone(), y))
        return torch.cat([eps_hat, v], dim=1)

    t = torch.tensor([0, 500])
    terms = d.training_losses(model_fn, x0, t, model_kwargs={"y": "label"}, noise=noise)
    assert set(terms) == {"loss", "mse", "vb"} and all(terms[k].shape == (2,) for k in terms)
    assert torch.equal(seen[0][0], t) and seen[0][1] == "label"

    mse_hand = ((noise - eps_hat) ** 2).mean(dim=(1, 2, 3)).detach()
    assert torch.allclose(terms["mse"].detach(), mse_hand, rtol=1e-12)
    assert terms["mse"][0].item() == pytest.approx((0.01 + 0.04 + 0.0025 + 0.09) / 4, rel=1e-9)
    for i, ti in enumerate(t.tolist()):
        hand = _hand_vb_bits(d, x0[i].numpy(), noise[i].numpy(), eps_hat[i].detach().numpy(), v[i].detach().numpy(), ti)
        assert terms["vb"][i].item() == pytest.approx(hand, rel=1e-8)
    assert torch.allclose(terms["loss"], terms["mse"] + terms["vb"])

    # vb trains only the variance head; mse only epsilon.
    g_eps, g_v = torch.autograd.grad(terms["vb"].sum(), [eps_hat, v], retain_graph=True, allow_unused=True)
    assert g_eps is None or torch.count_nonzero(g_eps) == 0
    assert g_v is not None and torch.count_nonzero(g_v) > 0
    g_eps, g_v = torch.autograd.grad(terms["mse"].sum(), [eps_hat, v], allow_unused=True)
    assert torch.count_nonzero(g_eps) > 0 and (g_v is None or torch.count_nonzero(g_v) == 0)


def test_training_losses_fixed_variance_is_plain_mse():
    d = create_diffusion(learn_sigma=False)
    assert d.model_var_type == "fixed_large"
    assert create_diffusion(learn_sigma=False, sigma_small=True).model_var_type == "fixed_small"
    x0, noise = torch.randn(SHAPE), torch.randn(SHAPE)
    terms = d.training_losses(lambda x, t: 0.5 * x, x0, torch.tensor([1, 900]), noise=noise)
    xt = d.q_sample(x0, torch.tensor([1, 900]), noise)
    assert torch.allclose(terms["loss"], mean_flat((noise - 0.5 * xt) ** 2))
    assert torch.count_nonzero(terms["vb"]) == 0
    with pytest.raises(ValueError, match="output channels"):
        d.training_losses(lambda x, t: torch.cat([x, x], 1), x0, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="output channels"):
        create_diffusion().training_losses(lambda x, t: x, x0, torch.tensor([1, 2]))


def test_kl_loss_type_trains_epsilon_too():
    d = create_diffusion(loss_type="kl")
    eps_hat = torch.randn(SHAPE, requires_grad=True)
    terms = d.training_losses(
        lambda x, t: torch.cat([eps_hat, torch.zeros_like(x)], 1), torch.randn(SHAPE), torch.tensor([5, 50])
    )
    assert torch.equal(terms["loss"], terms["vb"])
    (g,) = torch.autograd.grad(terms["loss"].sum(), [eps_hat])
    assert torch.count_nonzero(g) > 0


def test_learned_range_variance_interpolates():
    d = create_diffusion()
    x = torch.randn(SHAPE, dtype=torch.float64)
    t = torch.tensor([0, 600])
    for value, table in [(1.0, np.log(d.betas)), (-1.0, d.posterior_log_variance_clipped)]:
        out = d.p_mean_variance(
            lambda x, t, value=value: torch.cat([torch.zeros_like(x), torch.full_like(x, value)], 1), x, t
        )
        assert torch.allclose(out["log_variance"][:, 0, 0, 0], torch.tensor(table[[0, 600]]))
        assert torch.allclose(out["variance"], torch.exp(out["log_variance"]))
    assert set(out) == {"mean", "variance", "log_variance", "pred_xstart", "eps"}


# --------------------------------------------------------------------------------------
# Respacing
# --------------------------------------------------------------------------------------


def test_space_timesteps():
    s = space_timesteps(1000, "250")
    assert len(s) == 250 and 0 in s and 999 in s
    assert space_timesteps(1000, "ddim50") == set(range(0, 1000, 20))
    assert space_timesteps(1000, "1000") == set(range(1000))
    # Two sections of 50, each at stride 49/9 rounded.
    first = [0, 5, 11, 16, 22, 27, 33, 38, 44, 49]
    assert space_timesteps(100, "10,10") == set(first) | {50 + i for i in first}
    assert space_timesteps(100, [10, 10]) == space_timesteps(100, "10,10")
    # Stride 99/14: the 8th position is 49.5 up to float accumulation, which lands below the
    # tie; the reference therefore keeps 49 (computing 7 * stride would round to 50).
    assert sorted(space_timesteps(100, "15")) == [0, 7, 14, 21, 28, 35, 42, 49, 57, 64, 71, 78, 85, 92, 99]
    # Uneven split: the first section is the longer one.
    assert space_timesteps(11, [1, 1]) == {0, 6}
    assert space_timesteps(10, [2, 1]) == {0, 4, 5}
    with pytest.raises(ValueError):
        space_timesteps(1000, "ddim999")
    with pytest.raises(ValueError):
        space_timesteps(10, "6,6")


def test_spaced_diffusion_tables():
    betas = get_named_beta_schedule("linear", 1000)
    base = GaussianDiffusion(betas=betas)
    full = SpacedDiffusion(range(1000), betas=betas)
    assert np.allclose(full.betas, base.betas, rtol=1e-9, atol=0)
    assert full.timestep_map == list(range(1000))
    use = space_timesteps(1000, "25")
    spaced = SpacedDiffusion(use, betas=betas)
    assert spaced.num_timesteps == 25 and spaced.timestep_map == sorted(use)
    assert np.allclose(spaced.alphas_cumprod, base.alphas_cumprod[sorted(use)], rtol=1e-12, atol=0)
    assert create_diffusion("25").timestep_map == spaced.timestep_map


def test_spaced_model_receives_original_timesteps():
    d = create_diffusion("ddim10")
    assert d.timestep_map == list(range(0, 1000, 100))
    seen: list[list[int]] = []

    def model_fn(x, t):
        seen.append(t.tolist())
        return torch.cat([torch.zeros_like(x), torch.zeros_like(x)], 1)

    d.training_losses(model_fn, torch.zeros(SHAPE), torch.tensor([0, 3]))
    assert seen == [[0, 300]]
    seen.clear()
    d.ddim_sample_loop(model_fn, SHAPE)
    assert seen == [[s, s] for s in range(900, -1, -100)]
    seen.clear()
    d.p_sample_loop(model_fn, SHAPE, generator=torch.Generator().manual_seed(0))
    assert seen == [[s, s] for s in range(900, -1, -100)]
    seen.clear()
    d.p_mean_variance(model_fn, torch.zeros(SHAPE), torch.tensor([9, 1]))
    assert seen == [[900, 100]]


# --------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------


def _toy_model(x, t):
    return torch.cat([0.3 * x, torch.tanh(x)], 1)


@pytest.mark.parametrize("loop", ["p_sample_loop", "ddim_sample_loop"])
def test_sampling_deterministic_with_generator(loop):
    d = create_diffusion("10")
    kwargs = {"eta": 0.5} if loop == "ddim_sample_loop" else {}
    run = lambda seed: getattr(d, loop)(_toy_model, SHAPE, generator=torch.Generator().manual_seed(seed), **kwargs)  # noqa: E731
    a, b, c = run(0), run(0), run(1)
    assert a.shape == SHAPE and torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_ddim_eta0_deterministic_given_noise():
    d = create_diffusion("10")
    noise = torch.randn(SHAPE)
    a = d.ddim_sample_loop(_toy_model, SHAPE, noise=noise)
    torch.manual_seed(123)  # the global RNG must not matter
    b = d.ddim_sample_loop(_toy_model, SHAPE, noise=noise.clone())
    assert torch.equal(a, b)
    assert not torch.allclose(a, d.ddim_sample_loop(_toy_model, SHAPE, noise=noise, eta=1.0))


def test_p_sample_step_formula():
    d = create_diffusion("10")
    x = torch.randn(SHAPE)
    t = torch.tensor([0, 4])
    out = d.p_mean_variance(_toy_model, x, t)
    step = d.p_sample(_toy_model, x, t, generator=torch.Generator().manual_seed(7))
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(step["sample"][0], out["mean"][0])  # no noise at t == 0
    assert torch.allclose(step["sample"][1], out["mean"][1] + torch.exp(0.5 * out["log_variance"][1]) * z[1])


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_step_formula(eta):
    """One DDIM step on a spaced process against DDIM eq. 12 with acp from the base betas."""
    d = create_diffusion("10")
    betas = create_diffusion().betas
    x = torch.randn(SHAPE, dtype=torch.float64)
    t = torch.tensor([0, 4])
    eps = d.p_mean_variance(_toy_model, x, t)["eps"]
    step = d.ddim_sample(_toy_model, x, t, eta=eta, generator=torch.Generator().manual_seed(3))
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for i, k in enumerate(t.tolist()):
        ab = _acp(betas, d.timestep_map[k])
        ab_prev = _acp(betas, d.timestep_map[k - 1]) if k > 0 else 1.0
        pred_x0 = (x[i] - math.sqrt(1 - ab) * eps[i]) / math.sqrt(ab)
        sigma = eta * math.sqrt((1 - ab_prev) / (1 - ab)) * math.sqrt(1 - ab / ab_prev)
        if eta == 1.0 and k > 0:  # eta = 1 is the DDPM posterior's standard deviation
            assert sigma == pytest.approx(math.sqrt(d.posterior_variance[k]), rel=1e-9)
        hand = math.sqrt(ab_prev) * pred_x0 + math.sqrt(1 - ab_prev - sigma**2) * eps[i] + sigma * z[i]
        assert torch.allclose(step["sample"][i], hand, rtol=1e-9, atol=1e-12)
        assert torch.allclose(step["pred_xstart"][i], pred_x0, rtol=1e-9)


@pytest.mark.parametrize(
    "respacing, loop",
    [("ddim25", "ddim_sample_loop"), ("", "ddim_sample_loop"), ("10", "p_sample_loop"), ("", "p_sample_loop")],
)
def test_samplers_recover_known_x0(respacing, loop):
    """A model returning the true epsilon for a fixed x0 must make the samplers land on x0."""
    d = create_diffusion(respacing)
    base = create_diffusion()
    x0 = torch.tensor([0.7, -0.4, 1.3, -1.1]).view(1, 1, 2, 2).expand(SHAPE)

    def oracle(x, t):  # t are original indices, so the base tables apply
        a = torch.tensor(base.alphas_cumprod, dtype=x.dtype)[t].view(-1, 1, 1, 1)
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
        return torch.cat([eps, torch.zeros_like(x)], 1)

    out = getattr(d, loop)(oracle, SHAPE, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out, x0, atol=1e-4)


def test_progressive_and_progress_bar():
    d = create_diffusion("5")
    noise = torch.randn(SHAPE)
    steps = list(d.ddim_sample_loop_progressive(_toy_model, SHAPE, noise=noise, progress=True))
    assert [s["t"][0].item() for s in steps] == [4, 3, 2, 1, 0]
    assert set(steps[-1]) == {"sample", "pred_xstart", "t"}
    assert torch.equal(steps[-1]["sample"], d.ddim_sample_loop(_toy_model, SHAPE, noise=noise))
    with pytest.raises(ValueError):
        d.p_sample_loop(_toy_model, SHAPE, noise=torch.randn(3, 1, 2, 2))


# --------------------------------------------------------------------------------------
# The cosine schedule end to end (improved DDPM): closed forms and an exact denoiser
# --------------------------------------------------------------------------------------


def _cos_bar(s: float) -> float:
    return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2


def test_cosine_tables_closed_form():
    d = create_diffusion(noise_schedule="cosine")
    T = 1000
    hand = np.array([min(1 - _cos_bar((i + 1) / T) / _cos_bar(i / T), 0.999) for i in range(T)])
    np.testing.assert_allclose(d.betas, hand, rtol=1e-12, atol=0)
    # Only the last beta is capped (alpha_bar(1) = 0): acp telescopes to alpha_bar up to t = 998.
    assert d.betas[:-1].max() < 0.999 and d.betas[-1] == 0.999
    assert d.alphas_cumprod[998] == pytest.approx(_cos_bar(0.999) / _cos_bar(0.0), rel=1e-9)
    assert d.alphas_cumprod[999] == pytest.approx(0.001 * d.alphas_cumprod[998], rel=1e-9)
    assert d.alphas_cumprod[999] == pytest.approx(2.43e-9, rel=1e-2)  # x0 = x/sqrt(acp) - ...: x 2e4
    for t in (1, 500, 999):
        ab, ab_prev = _acp(d.betas, t), _acp(d.betas, t - 1)
        assert d.posterior_variance[t] == pytest.approx(d.betas[t] * (1 - ab_prev) / (1 - ab), rel=1e-9)
        assert d.posterior_mean_coef1[t] == pytest.approx(d.betas[t] * math.sqrt(ab_prev) / (1 - ab), rel=1e-9)
        assert d.posterior_mean_coef2[t] == pytest.approx(
            (1 - ab_prev) * math.sqrt(1 - d.betas[t]) / (1 - ab), rel=1e-9
        )
    assert (
        d.posterior_log_variance_clipped[0] == d.posterior_log_variance_clipped[1] == math.log(d.posterior_variance[1])
    )
    # At t = 999 the learned range spans log(beta) and the posterior's, which nearly coincide:
    # the variance head cannot matter there.
    assert abs(math.log(d.betas[999]) - d.posterior_log_variance_clipped[999]) < 1e-5


@pytest.mark.parametrize("respacing", ["10", "100", "ddim50"])
def test_respaced_cosine_keeps_the_marginals(respacing):
    base, spaced = create_diffusion(noise_schedule="cosine"), create_diffusion(respacing, noise_schedule="cosine")
    kept = spaced.timestep_map
    np.testing.assert_allclose(
        spaced.alphas_cumprod, base.alphas_cumprod[kept], rtol=1e-8, atol=0
    )  # 1 - (1 - a) rounds
    prev = np.append(1.0, base.alphas_cumprod[kept][:-1])
    np.testing.assert_allclose(spaced.betas, 1 - base.alphas_cumprod[kept] / prev, rtol=1e-10, atol=0)
    assert spaced.betas[0] == base.betas[0] and (spaced.betas < 1).all()


@pytest.mark.parametrize(
    "respacing, sampler", [("250", "p_sample_loop"), ("100", "p_sample_loop"), ("100", "ddim_sample_loop")]
)
def test_exact_denoiser_samples_the_data_under_cosine_unclipped(respacing, sampler):
    """Pixels independently -1 or +1: E[x0 | x_t] = tanh(sqrt(acp) x_t / (1 - acp)) exactly. With
    this denoiser every x_t of a correct sampler has unit variance (acp E[x0^2] + 1 - acp), even
    through the cosine schedule's last step (acp 2.4e-9) and without clipping; the samples are
    the data's +-1. A wrong schedule, respacing, posterior or variance would drift."""
    d = create_diffusion(respacing, noise_schedule="cosine")
    acp = torch.tensor(create_diffusion(noise_schedule="cosine").alphas_cumprod)
    shape = (16, 1, 16, 16)

    def oracle(x, t):
        a = acp[t].view(-1, 1, 1, 1)
        x0 = torch.tanh(a.sqrt() * x / (1 - a))
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
        return torch.cat([eps, torch.full_like(x, -1.0)], 1)  # v = -1: the posterior variance

    g = torch.Generator().manual_seed(0)
    noise = torch.randn(shape, generator=g, dtype=torch.float64)
    stds = []
    for out in getattr(d, sampler + "_progressive")(oracle, shape, noise=noise, generator=g):
        stds.append(out["sample"].std().item())
    assert max(abs(s - 1) for s in stds) < 0.1, stds
    final = out["sample"]
    assert final.abs().max() <= 1 + 1e-9 and (final.abs() > 0.99).float().mean() > 0.97
    assert abs(final.mean().item()) < 0.1


def test_the_timestep_map_reaches_the_device_once_not_every_step():
    """The respaced model wrapper is made per call; the table mapping spaced to original timesteps
    is the diffusion's, so it is copied to the device once (a copy per step stalls a GPU's queue:
    CUDA's sync-debug mode in `make gpu-check` found it), and it stays out of pickles."""
    import pickle

    d = create_diffusion("", diffusion_steps=1000)  # training: all 1000 steps, through SpacedDiffusion
    assert isinstance(d, SpacedDiffusion)
    seen: list[torch.Tensor] = []

    def model_fn(x, t, **kwargs):
        seen.append(t)
        return torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])

    x = torch.randn(2, 1, 4, 4)
    for _ in range(2):
        d.training_losses(model_fn, x, torch.tensor([3, 999]))
    assert [t.tolist() for t in seen] == [[3, 999], [3, 999]]
    assert list(d._map_cache) == [torch.device("cpu")]
    table = d._map_cache[torch.device("cpu")]
    d.training_losses(model_fn, x, torch.tensor([0, 1]))
    assert d._map_cache[torch.device("cpu")] is table
    assert pickle.loads(pickle.dumps(d))._map_cache == {}
