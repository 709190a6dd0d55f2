"""An independent yardstick for REG's training loss: ``loss.py`` of github.com/Martinser/REG at commit
021ea2e50c38c5803bd9afff16316958a01fbd1d (``mean_flat``, ``sum_flat``, ``SILoss`` with its
``interpolant`` and ``__call__``), transcribed expression for expression with REG's signatures and
defaults, and the lines of its ``train.py`` (L313-320) that combine the terms. REG's conventions: time
runs from data (t = 0) to noise (t = 1), ``alpha_t = 1 - t``, ``sigma_t = t``, and the velocity
target is ``d_alpha_t * x + d_sigma_t * noise = noise - x``, for the latents and for the class token
alike, at the same time.

Kept as REG has it: the time and the noises are drawn inside ``__call__`` (``torch.rand`` then
``torch.randn_like`` for the latents, then for the class token), and passing ``noises`` raises
NameError (``noises_cls`` is only defined when REG draws the noises itself): a test seeds torch and
replays that draw order.
"""

import numpy as np
import torch


def mean_flat(x):
    """
    Take the mean over all non-batch dimensions.
    """
    return torch.mean(x, dim=list(range(1, len(x.size()))))


def sum_flat(x):
    """
    Take the mean over all non-batch dimensions.
    """
    return torch.sum(x, dim=list(range(1, len(x.size()))))


class SILoss:
    def __init__(
        self,
        prediction="v",
        path_type="linear",
        weighting="uniform",
        encoders=[],  # noqa: B006  (REG's default)
        accelerator=None,
        latents_scale=None,
        latents_bias=None,
    ):
        self.prediction = prediction
        self.weighting = weighting
        self.path_type = path_type
        self.encoders = encoders
        self.accelerator = accelerator
        self.latents_scale = latents_scale
        self.latents_bias = latents_bias

    def interpolant(self, t):
        if self.path_type == "linear":
            alpha_t = 1 - t
            sigma_t = t
            d_alpha_t = -1
            d_sigma_t = 1
        elif self.path_type == "cosine":
            alpha_t = torch.cos(t * np.pi / 2)
            sigma_t = torch.sin(t * np.pi / 2)
            d_alpha_t = -np.pi / 2 * torch.sin(t * np.pi / 2)
            d_sigma_t = np.pi / 2 * torch.cos(t * np.pi / 2)
        else:
            raise NotImplementedError()

        return alpha_t, sigma_t, d_alpha_t, d_sigma_t

    def __call__(
        self,
        model,
        images,
        model_kwargs=None,
        zs=None,
        cls_token=None,
        time_input=None,
        noises=None,
    ):
        if model_kwargs == None:  # noqa: E711  (REG's spelling)
            model_kwargs = {}
        # sample timesteps
        if time_input is None:
            if self.weighting == "uniform":
                time_input = torch.rand((images.shape[0], 1, 1, 1))
            elif self.weighting == "lognormal":
                # sample timestep according to log-normal distribution of sigmas following EDM
                rnd_normal = torch.randn((images.shape[0], 1, 1, 1))
                sigma = rnd_normal.exp()
                if self.path_type == "linear":
                    time_input = sigma / (1 + sigma)
                elif self.path_type == "cosine":
                    time_input = 2 / np.pi * torch.atan(sigma)

        time_input = time_input.to(device=images.device, dtype=images.dtype)

        if noises is None:
            noises = torch.randn_like(images)
            noises_cls = torch.randn_like(cls_token)

        alpha_t, sigma_t, d_alpha_t, d_sigma_t = self.interpolant(time_input)

        model_input = alpha_t * images + sigma_t * noises
        cls_input = alpha_t.squeeze(-1).squeeze(-1) * cls_token + sigma_t.squeeze(-1).squeeze(-1) * noises_cls
        if self.prediction == "v":
            model_target = d_alpha_t * images + d_sigma_t * noises
            cls_target = d_alpha_t * cls_token + d_sigma_t * noises_cls
        else:
            raise NotImplementedError()

        model_output, zs_tilde, cls_output = model(
            model_input, time_input.flatten(), **model_kwargs, cls_token=cls_input
        )

        # denoising_loss
        denoising_loss = mean_flat((model_output - model_target) ** 2)
        denoising_loss_cls = mean_flat((cls_output - cls_target) ** 2)

        # projection loss
        proj_loss = 0.0
        bsz = zs[0].shape[0]
        for i, (z, z_tilde) in enumerate(zip(zs, zs_tilde)):  # noqa: B007
            for j, (z_j, z_tilde_j) in enumerate(zip(z, z_tilde)):  # noqa: B007
                z_tilde_j = torch.nn.functional.normalize(z_tilde_j, dim=-1)
                z_j = torch.nn.functional.normalize(z_j, dim=-1)
                proj_loss += mean_flat(-(z_j * z_tilde_j).sum(dim=-1))
        proj_loss /= len(zs) * bsz

        return denoising_loss, proj_loss, time_input, noises, denoising_loss_cls


def train_loss(loss_fn, model, x, model_kwargs, zs, cls_token, proj_coeff=0.5, cls=0.03):
    """train.py L313-320 (``proj_coeff`` and ``cls`` are its ``--proj-coeff`` and ``--cls`` defaults):
    the total loss and REG's three terms."""
    loss1, proj_loss1, time_input, noises, loss2 = loss_fn(
        model, x, model_kwargs, zs=zs, cls_token=cls_token, time_input=None, noises=None
    )
    loss_mean = loss1.mean()
    loss_mean_cls = loss2.mean() * cls
    proj_loss_mean = proj_loss1.mean() * proj_coeff
    loss = loss_mean + proj_loss_mean + loss_mean_cls
    return loss, loss1, proj_loss1, loss2
