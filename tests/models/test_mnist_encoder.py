"""The MNIST benchmark's stand-in for DINOv2 (``MNISTEncoder``): 49 patch tokens after a class token,
normalised as DINOv2's ``x_norm`` outputs; read by ``FrozenEncoder.encode`` as REG's class token."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from dit_lightning.models.encoders import load_encoder
from dit_lightning.models.repa import MNISTEncoder, REPAOptions, train_digits_encoder


def test_mnist_encoder_gives_the_pooled_class_token_first_then_49_patches_layer_normed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = MNISTEncoder()
    with torch.no_grad():
        net.norm.weight.uniform_(0.5, 2.0)  # a trained norm: the output is its affine map, not unit-scaled
        net.norm.bias.uniform_(-1.0, 1.0)
    torch.save(net.state_dict(), tmp_path / "enc.pt")
    images = torch.rand(3, 1, 28, 28)
    encoder = load_encoder(
        REPAOptions(encoder="dit_lightning.models.repa.MNISTEncoder", weights=str(tmp_path / "enc.pt"))
    )
    assert encoder.has_class_token
    patches, token = encoder.encode(images)
    assert patches.shape == (3, 49, 64) and token is not None and token.shape == (3, 64)
    with torch.no_grad():
        raw = net.features(images * 2 - 1).flatten(2).transpose(1, 2)  # (3, 49, 64), row-major 7x7
        norm = F.layer_norm(torch.cat([raw.mean(1, keepdim=True), raw], 1), (64,), eps=1e-6)
    torch.testing.assert_close(token, norm[:, 0] * net.norm.weight + net.norm.bias)
    torch.testing.assert_close(patches, norm[:, 1:] * net.norm.weight + net.norm.bias)
    torch.testing.assert_close(encoder(images), patches)  # REPA's forward: the patches only
    plain = MNISTEncoder()(images)  # the initial affine (1, 0): every token has mean 0 and variance 1
    torch.testing.assert_close(plain.mean(-1), torch.zeros(3, 50), atol=1e-5, rtol=0)
    torch.testing.assert_close(plain.var(-1, unbiased=False), torch.ones(3, 50), atol=1e-2, rtol=0)  # eps


def test_train_digits_encoder_trains_the_mnist_encoder_as_a_classifier_of_its_class_token() -> None:
    labels = torch.arange(4).repeat(8)
    images = torch.rand(32, 1, 28, 28) * 0.2
    for i, d in enumerate(labels.tolist()):  # a bright bar whose row says the class
        images[i, 0, 4 + 5 * d : 7 + 5 * d, 4:24] = 1.0
    untrained = MNISTEncoder(num_classes=4)
    net = train_digits_encoder(images, labels, steps=30, batch_size=16, encoder_class=MNISTEncoder)
    assert isinstance(net, MNISTEncoder) and not net.training
    with torch.no_grad():
        assert (net.logits(images).argmax(1) == labels).float().mean() == 1.0
        assert (untrained.logits(images).argmax(1) == labels).float().mean() < 0.5
