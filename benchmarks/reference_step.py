"""A reference-style DiT training step, for side-by-side speed comparisons.

Written from the paper's equations the way the reference code does it: explicit softmax
attention (``softmax(q k^T / sqrt(d)) v``, the T x T matrix materialised, no fused kernel),
fp32 only, ``torch.randint`` timesteps and ``torch.rand`` label dropout, the default
``torch.optim.AdamW`` (lr 1e-4, no weight decay) and a per-parameter Python loop for the EMA.
The module names match the released checkpoints, so the project's weights load into it and
both networks compute the same function (checked by :func:`max_abs_difference`).

The diffusion loss is the project's ``create_diffusion`` (the same ADM equations the reference
calls), so a comparison isolates the network, the optimiser and the EMA update.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dit_lightning.diffusion import create_diffusion
from dit_lightning.models.dit import DiT, sincos_2d


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def _norm(x: Tensor) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(x).reshape(n, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # the T x T scores
        out = attn.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(n, t, d))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.attn = _Attention(dim, heads)
        self.mlp = _Mlp(dim, int(dim * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        s1, sc1, g1, s2, sc2, g2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + g1[:, None] * self.attn(_modulate(_norm(x), s1, sc1))
        return x + g2[:, None] * self.mlp(_modulate(_norm(x), s2, sc2))


class ReferenceDiT(nn.Module):
    """The DiT network, plainly: patchify, + sin-cos positions, adaLN-Zero blocks, unpatchify."""

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
    ) -> None:
        super().__init__()
        self.p, self.num_classes, self.dropout = patch_size, num_classes, class_dropout_prob
        self.out_channels = 2 * in_channels if learn_sigma else in_channels
        d = hidden_size
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv2d(in_channels, d, patch_size, stride=patch_size)
        grid = input_size // patch_size
        self.pos_embed = nn.Parameter(torch.from_numpy(sincos_2d(d, grid)).float()[None], requires_grad=False)
        self.t_embedder = nn.Module()
        self.t_embedder.mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.y_embedder = nn.Module()
        self.y_embedder.embedding_table = nn.Embedding(num_classes + int(class_dropout_prob > 0), d)
        self.blocks = nn.ModuleList(_Block(d, num_heads, mlp_ratio) for _ in range(depth))
        self.final_layer = nn.Module()
        self.final_layer.linear = nn.Linear(d, patch_size * patch_size * self.out_channels)
        self.final_layer.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        # The holders are bare nn.Module()s (for the reference's parameter names): type their children.
        proj = cast(nn.Conv2d, self.x_embedder.proj)
        t_mlp = cast(nn.Sequential, self.t_embedder.mlp)
        table = cast(nn.Embedding, self.y_embedder.embedding_table)
        final_mod = cast(nn.Sequential, self.final_layer.adaLN_modulation)
        final_linear = cast(nn.Linear, self.final_layer.linear)
        n, _, h, w = x.shape
        tok = proj(x).flatten(2).transpose(1, 2) + self.pos_embed
        freqs = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=torch.float32, device=x.device) / 128)
        args = t.float()[:, None] * freqs[None]
        c = t_mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))
        if self.training and self.dropout > 0:
            y = torch.where(torch.rand(n, device=x.device) < self.dropout, torch.full_like(y, self.num_classes), y)
        c = c + table(y)
        for block in self.blocks:
            tok = block(tok, c)
        shift, scale = final_mod(c).chunk(2, dim=1)
        out = final_linear(_modulate(_norm(tok), shift, scale))
        p, co = self.p, self.out_channels
        out = out.reshape(n, h // p, w // p, p, p, co).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(n, co, h, w)


class ReferenceTrainingStep:
    """One optimiser step as the reference loop runs it (fp32, plain attention, looped EMA)."""

    def __init__(self, model: ReferenceDiT, batch: dict[str, Tensor], ema_decay: float = 0.9999) -> None:
        self.model = model.train()
        self.ema = copy.deepcopy(model).requires_grad_(False).eval()
        self.batch = batch
        self.decay = ema_decay
        self.diffusion = create_diffusion("")
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)

    @torch.no_grad()
    def _update_ema(self) -> None:
        ema_params = dict(self.ema.named_parameters())
        for name, param in self.model.named_parameters():
            ema_params[name].mul_(self.decay).add_(param.data, alpha=1 - self.decay)

    def __call__(self) -> float:
        x, y = self.batch["x"], self.batch["y"]
        t = torch.randint(0, self.diffusion.num_timesteps, (x.shape[0],), device=x.device)
        loss = self.diffusion.training_losses(self.model, x, t, model_kwargs={"y": y})["loss"].mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self._update_ema()
        return float(loss.detach())

    def state_bytes(self) -> int:
        from dit_lightning.planner.measure import tensor_bytes

        tensors: list[Tensor] = [*self.model.parameters(), *self.ema.parameters()]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
        tensors += [v for v in self.batch.values() if torch.is_tensor(v)]
        return tensor_bytes(tensors)


@torch.no_grad()
def max_abs_difference(project_model: DiT, reference: ReferenceDiT, batch: int = 2, seed: int = 0) -> float:
    """Load the project's weights into the reference network and compare the outputs (eval)."""
    missing = reference.load_state_dict(project_model.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    p = next(project_model.parameters())
    g = torch.Generator(device="cpu").manual_seed(seed)
    size = project_model.input_size
    x = torch.randn(batch, project_model.in_channels, size, size, generator=g).to(p.device)
    t = torch.randint(0, 1000, (batch,), generator=g).to(p.device)
    y = torch.randint(0, project_model.num_classes, (batch,), generator=g).to(p.device)
    was = project_model.training, reference.training
    project_model.eval(), reference.eval()
    # non-zero adaLN/final weights so the comparison exercises every block (adaLN-Zero starts at 0)
    for m in (project_model, reference):
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        for prm in m.parameters():
            if prm.requires_grad:
                prm.copy_((torch.randn(prm.shape, generator=gen) * 0.02).to(prm.device))
    diff = (project_model(x, t, y) - reference(x, t, y)).abs().max().item()
    project_model.train(was[0]), reference.train(was[1])
    return diff


def build_reference(shape_kwargs: dict, device: Optional[torch.device] = None) -> ReferenceDiT:
    """A reference network with the sizes of a project DiT (``DiTShape`` fields)."""
    keys = (
        "input_size",
        "patch_size",
        "in_channels",
        "hidden_size",
        "depth",
        "num_heads",
        "mlp_ratio",
        "class_dropout_prob",
        "num_classes",
        "learn_sigma",
    )
    with torch.device(device or "cpu"):  # initialise on the device (fast for large models)
        model = ReferenceDiT(**{k: shape_kwargs[k] for k in keys if k in shape_kwargs})
    return model.to(device or "cpu")  # pos_embed comes from numpy, on the CPU
