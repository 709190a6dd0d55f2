"""An independent yardstick for REPA: its loss (github.com/sihyun-yu/REPA, ``loss.py``: ``SILoss``) and
its projector (``models/sit.py``: ``build_mlp`` and the ``forward`` that applies it after block
``encoder_depth``), transcribed one expression at a time in REPA's own conventions: time runs from
data (t = 0) to noise (t = 1), ``alpha_t = 1 - t``, ``sigma_t = t``, and the velocity target is
``d_alpha_t * x + d_sigma_t * noise = noise - x``.

What differs from REPA by construction, marked: the time and the noise are arguments (REPA draws them
with ``torch.rand`` / ``torch.randn_like`` inside ``__call__``), so that the same draws can be given
to both implementations.
"""

from __future__ import annotations

import torch


def mean_flat(x):
    # loss.py: mean_flat (note: for a 1-D tensor dim=[] reduces over everything)
    return torch.mean(x, dim=list(range(1, len(x.size()))))


def build_mlp(hidden_size, projector_dim, z_dim):
    # models/sit.py: build_mlp
    return torch.nn.Sequential(
        torch.nn.Linear(hidden_size, projector_dim),
        torch.nn.SiLU(),
        torch.nn.Linear(projector_dim, projector_dim),
        torch.nn.SiLU(),
        torch.nn.Linear(projector_dim, z_dim),
    )


def linear_interpolant(t):
    # loss.py: SILoss.interpolant, path_type == "linear"
    alpha_t = 1 - t
    sigma_t = t
    d_alpha_t = -1
    d_sigma_t = 1
    return alpha_t, sigma_t, d_alpha_t, d_sigma_t


def si_loss(model, images, time_input, noises, model_kwargs=None, zs=None):
    """loss.py: SILoss.__call__ with prediction "v" and the linear path; returns
    (denoising_loss, proj_loss) as REPA does. ``time_input`` (N,) and ``noises`` are given (REPA
    draws them)."""
    if model_kwargs is None:
        model_kwargs = {}
    time_input = time_input.view(-1, 1, 1, 1).to(device=images.device, dtype=images.dtype)  # differs: given
    alpha_t, sigma_t, d_alpha_t, d_sigma_t = linear_interpolant(time_input)
    model_input = alpha_t * images + sigma_t * noises
    model_target = d_alpha_t * images + d_sigma_t * noises
    model_output, zs_tilde = model(model_input, time_input.flatten(), **model_kwargs)
    denoising_loss = mean_flat((model_output - model_target) ** 2)

    proj_loss = 0.0
    bsz = zs[0].shape[0]
    for _i, (z, z_tilde) in enumerate(zip(zs, zs_tilde)):
        for _j, (z_j, z_tilde_j) in enumerate(zip(z, z_tilde)):
            z_tilde_j = torch.nn.functional.normalize(z_tilde_j, dim=-1)
            z_j = torch.nn.functional.normalize(z_j, dim=-1)
            proj_loss += mean_flat(-(z_j * z_tilde_j).sum(dim=-1))
    proj_loss /= len(zs) * bsz
    return denoising_loss, proj_loss


def train_loss(model, images, time_input, noises, zs, proj_coeff, model_kwargs=None):
    """train.py: ``loss = loss_mean + proj_loss_mean * args.proj_coeff``."""
    loss, proj_loss = si_loss(model, images, time_input, noises, model_kwargs=model_kwargs, zs=zs)
    loss_mean = loss.mean()
    proj_loss_mean = proj_loss.mean()
    return loss_mean + proj_loss_mean * proj_coeff, loss_mean, proj_loss_mean
