"""Flow matching (dit_lightning.diffusion.flow) against SiT's transport formulas (tests/helpers/sit_reference.py):
the losses of every path x prediction x weight, the drift, score and diffusion coefficients, the time
intervals and epsilons, the training times."""

import itertools

import numpy as np
import pytest
import torch

from dit_lightning.diffusion import FlowMatching
from tests.helpers import sit_reference as sit
from tests.helpers.models import random_dit

pytestmark = pytest.mark.usefixtures("one_thread")

PATHS = {"linear": "Linear", "gvp": "GVP", "vp": "VP"}
PREDICTIONS = ("velocity", "noise", "score")
COMBOS = [
    (path, prediction, weight)
    for path, prediction in itertools.product(PATHS, PREDICTIONS)
    for weight in (("none",) if prediction == "velocity" else ("none", "velocity", "likelihood"))
]


def reference(path, prediction, weight="none"):
    return sit.create_transport(PATHS[path], prediction, None if weight == "none" else weight)


def data(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 4, 8, 8, generator=g),
        torch.randn(n, 4, 8, 8, generator=g),
        torch.randint(0, 10, (n,), generator=g),
    )


@pytest.mark.parametrize("path,prediction,weight", COMBOS)
def test_training_loss_matches_sit(path, prediction, weight):
    flow = FlowMatching(path_type=path, prediction=prediction, loss_weight=weight)
    ref = reference(path, prediction, weight)
    net = random_dit()  # learn_sigma: 8 output channels, the first 4 used (SiT's layout)
    x1, x0, y = data()
    t0, t1 = ref.check_interval(ref.train_eps, ref.sample_eps)
    assert (t0, t1) == flow.interval(sampling=False)
    # the ends of the training interval too, where the weights are largest
    t = torch.tensor([t0, t1, 0.3, 0.77], dtype=torch.float32)
    with torch.no_grad():
        ours = flow.training_losses(net, x1, x0, t, model_kwargs={"y": y})["loss"]
        theirs = ref.training_losses(sit.sit_forward(net, learn_sigma=True), x1, t, x0, model_kwargs={"y": y})["loss"]
    assert ours.shape == (4,)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path,prediction", list(itertools.product(PATHS, PREDICTIONS)))
def test_drift_and_score_match_sit(path, prediction):
    flow, ref = FlowMatching(path_type=path, prediction=prediction), reference(path, prediction)
    x, out, _ = data(3, seed=1)
    t = torch.tensor([0.05, 0.5, 0.9])
    model = lambda x, t: out  # noqa: E731 - the network's prediction, fixed
    torch.testing.assert_close(flow.velocity(out, x, t), ref.get_drift()(x, t, model), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flow.score(out, x, t), ref.get_score()(x, t, model), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("form", ["sigma", "sbdm", "constant", "linear", "decreasing", "increasing-decreasing"])
def test_diffusion_coefficients_match_sit(path, form):
    flow, ref = FlowMatching(path_type=path), reference(path, "velocity")
    x = torch.randn(3, 4, 2, 2)
    t = torch.tensor([0.05, 0.5, 0.9])
    sit_form = "SBDM" if form == "sbdm" else form
    theirs = torch.as_tensor(ref.path_sampler.compute_diffusion(x, t, form=sit_form, norm=0.7)).float()
    ours = flow.diffusion(x, t, form, 0.7)
    torch.testing.assert_close(ours, theirs.expand_as(ours), rtol=1e-5, atol=1e-6)


def test_interpolant_ends_and_velocity_is_the_time_derivative():
    x1, x0, _ = data(2)
    for path in PATHS:
        flow = FlowMatching(path_type=path, prediction="noise")
        t = torch.tensor([0.3, 0.6], dtype=torch.float64)
        xt, ut = flow.interpolate(x1.double(), x0.double(), t)
        h = 1e-6
        numeric = (
            flow.interpolate(x1.double(), x0.double(), t + h)[0] - flow.interpolate(x1.double(), x0.double(), t - h)[0]
        ) / (2 * h)
        torch.testing.assert_close(ut, numeric, rtol=1e-6, atol=1e-6)
    lin = FlowMatching()
    ends = torch.tensor([0.0, 1.0])
    xt, _ = lin.interpolate(x1, x0, ends)
    torch.testing.assert_close(xt[0], x0[0])  # t = 0: noise
    torch.testing.assert_close(xt[1], x1[1])  # t = 1: data


@pytest.mark.parametrize("path,prediction", list(itertools.product(PATHS, PREDICTIONS)))
def test_epsilons_and_intervals_are_sits(path, prediction):
    flow, ref = FlowMatching(path_type=path, prediction=prediction), reference(path, prediction)
    assert (flow.train_eps, flow.sample_eps) == (ref.train_eps, ref.sample_eps)
    for form, last in itertools.product(["sigma", "sbdm"], [0.0, 0.04]):
        sit_form = "SBDM" if form == "sbdm" else form
        for sde in (False, True):
            theirs = ref.check_interval(
                ref.train_eps, ref.sample_eps, diffusion_form=sit_form, sde=sde, eval=True, last_step_size=last
            )
            ours = flow.interval(sampling=True, sde=sde, diffusion_form=form, last_step_size=last)
            assert ours == pytest.approx(theirs)


def test_epsilon_settings():
    assert FlowMatching(prediction="noise", train_eps=1e-3, sample_eps=2e-3).sample_eps == 2e-3
    with pytest.raises(ValueError, match="whole interval"):
        FlowMatching(train_eps=1e-3)  # SiT trains velocity on [0, 1]
    with pytest.raises(ValueError, match="noise or score prediction"):
        FlowMatching(loss_weight="likelihood")
    with pytest.raises(ValueError, match="path_type"):
        FlowMatching(path_type="cosine")


def test_training_times_uniform_and_logit_normal():
    u = (torch.arange(1000, dtype=torch.float32) + 0.5) / 1000
    uniform = FlowMatching(path_type="gvp", prediction="noise").training_time(u)
    ref = reference("gvp", "noise")
    t0, t1 = ref.check_interval(ref.train_eps, ref.sample_eps)  # SiT's Transport.sample: [1e-3, 1 - 1e-3] here
    torch.testing.assert_close(uniform, u * (t1 - t0) + t0)  # SiT: rand * (t1 - t0) + t0
    assert (t0, t1) == pytest.approx((1e-3, 1 - 1e-3))
    ln = FlowMatching(time_distribution="logit_normal", time_mean=0.5, time_std=0.8).training_time(u)
    assert 0 < ln.min() and ln.max() < 1
    # the noise level 1 - t is sigmoid(N(0.5, 0.8^2)): its logit's quantiles are the normal's
    logit_noise = torch.logit(1 - ln.double())
    normal = torch.distributions.Normal(0.5, 0.8)
    torch.testing.assert_close(logit_noise, normal.icdf(u.double()), rtol=1e-4, atol=1e-4)
    assert ln.median() < 0.5  # a positive mean puts the weight on noisier times (SD3's convention)


def test_cosine_loss_and_logit_normal_time_match_lightningdit():
    """LightningDiT's recipe (use_cosine_loss, use_lognorm; tests/helpers/lightningdit_transport_reference.py)
    on their own draws: their noise (torch) and logit-normal time (scipy) seeded, the same draws given to ours."""
    from scipy.special import ndtr

    from tests.helpers import lightningdit_transport_reference as ldit

    ref = ldit.create_transport("Linear", "velocity", None, None, None, use_cosine_loss=True, use_lognorm=True)
    flow = FlowMatching(time_distribution="logit_normal", cosine_loss=True)  # time_mean 0, time_std 1
    net = random_dit(learn_sigma=False)
    x1, _, y = data(6)
    with torch.no_grad():
        torch.manual_seed(5), np.random.seed(5)
        terms = ref.training_losses(net, x1, {"y": y})
        torch.manual_seed(5), np.random.seed(5)
        theirs = ldit.train_loss(ref, net, x1, {"y": y})  # train.py: loss.mean() + cos_loss.mean()
        torch.manual_seed(5), np.random.seed(5)
        noise = torch.randn_like(x1)
        n = ldit.norm.rvs(loc=0, scale=1, size=6)  # their t = sigmoid(n); ours sigmoid(-ndtri(u)): u = Phi(-n)
        u = torch.tensor(ndtr(-n), dtype=torch.float32)
        ours = flow.training_terms(net, x1, noise, u, {"y": y})
    torch.testing.assert_close(ours["velocity_mse"], terms["loss"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["cosine"], terms["cos_loss"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["loss"], terms["loss"] + terms["cos_loss"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["loss"].mean(), theirs, rtol=0, atol=1e-6)
    assert terms["cos_loss"].min() > 0.1  # a random network's velocity is far from the path's: the term counts
    # the cosine is over the channels at each position, then averaged (not over the flattened sample: 0.684)
    pred, target = torch.ones(1, 2, 1, 2), torch.tensor([[[[1.0, 2.0]], [[1.0, -2.0]]]])
    cosine = FlowMatching(cosine_loss=True).training_losses(
        lambda x, t, **k: pred, target, torch.zeros_like(target), torch.ones(1)
    )["cosine"]
    assert cosine.item() == pytest.approx(0.5)  # positions: 1 - cos = 0 and 1


def test_cosine_loss_is_velocity_only_and_recorded():
    with pytest.raises(ValueError, match="needs velocity prediction"):
        FlowMatching(prediction="noise", cosine_loss=True)
    flow = FlowMatching(time_distribution="logit_normal", cosine_loss=True)
    assert flow.record()["cosine_loss"] is True and "cosine loss" in flow.describe()
    assert FlowMatching().record()["cosine_loss"] is False
