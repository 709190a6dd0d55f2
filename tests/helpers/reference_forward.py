"""An independent, deliberately plain forward pass of DiT computed from a state dict.

Written from the paper's equations (explicit softmax attention, no modules), it is the
yardstick the module is compared with: if a key, a chunk order or a reshape in the model
were wrong, the two would disagree.
"""

import math

import torch
import torch.nn.functional as F


def _lin(sd, name, x):
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def _norm(x):
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


def reference_forward(sd, x, t, y, *, patch, heads, depth, out_channels):
    n, _, h, w = x.shape
    d = sd["pos_embed"].shape[-1]
    tok = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=patch)
    tok = tok.flatten(2).transpose(1, 2) + sd["pos_embed"]
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    temb = torch.cat([torch.cos(args), torch.sin(args)], -1)
    temb = _lin(sd, "t_embedder.mlp.2", F.silu(_lin(sd, "t_embedder.mlp.0", temb)))
    c = temb + sd["y_embedder.embedding_table.weight"][y]
    hd = d // heads
    for i in range(depth):
        p = f"blocks.{i}"
        mod = _lin(sd, f"{p}.adaLN_modulation.1", F.silu(c))
        sh1, sc1, g1, sh2, sc2, g2 = [m[:, None] for m in mod.split(d, dim=1)]
        a = _norm(tok) * (1 + sc1) + sh1
        qkv = _lin(sd, f"{p}.attn.qkv", a).reshape(n, -1, 3, heads, hd)
        q, k, v = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1) @ v
        tok = tok + g1 * _lin(sd, f"{p}.attn.proj", att.transpose(1, 2).reshape(n, -1, d))
        m = _norm(tok) * (1 + sc2) + sh2
        m = _lin(sd, f"{p}.mlp.fc2", F.gelu(_lin(sd, f"{p}.mlp.fc1", m), approximate="tanh"))
        tok = tok + g2 * m
    sh, sc = _lin(sd, "final_layer.adaLN_modulation.1", F.silu(c)).split(d, dim=1)
    out = _lin(sd, "final_layer.linear", _norm(tok) * (1 + sc[:, None]) + sh[:, None])
    gh, gw = h // patch, w // patch
    out = out.reshape(n, gh, gw, patch, patch, out_channels).permute(0, 5, 1, 3, 2, 4)
    return out.reshape(n, out_channels, h, w)
