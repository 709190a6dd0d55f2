"""REPA's frozen encoders load from local files only, whichever way they are named, and give patch
features without class / register tokens."""

import json

import pytest
import torch

from dit_lightning.models.encoders import feature_shape, load_encoder
from dit_lightning.models.repa import DigitsEncoder, REPAOptions, alignment_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_timm_model_loads_from_a_local_file_and_drops_its_class_token(tmp_path):
    timm = pytest.importorskip("timm")  # the repa / test extras install it
    net = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=0)
    path = tmp_path / "vit.pth"
    torch.save(net.state_dict(), path)
    encoder = load_encoder(REPAOptions(encoder="vit_tiny_patch16_224", weights=str(path), image_size=32))
    images = torch.rand(2, 3, 32, 32)
    z = encoder(images)
    assert z.shape == (2, 4, 192)  # 2x2 patches of 16 px, the [CLS] token dropped
    mean, std = torch.tensor([0.5] * 3).view(1, 3, 1, 1), torch.tensor([0.5] * 3).view(1, 3, 1, 1)  # timm's ViT
    expected = net.eval().forward_features((images - mean) / std)[:, 1:]
    torch.testing.assert_close(z, expected)
    assert feature_shape(encoder, (1, 32, 32)) == (4, 192)  # grey images become RGB
    assert timm.list_pretrained("vit_base_patch14_dinov2*") == ["vit_base_patch14_dinov2.lvd142m"]  # dinov2-vitb14
    with pytest.raises(ValueError, match="model.repa.weights"):
        load_encoder(REPAOptions(encoder="vit_tiny_patch16_224"))
    with pytest.raises(ValueError, match="not a timm model name"):
        load_encoder(REPAOptions(encoder="no_such_model_xyz", weights=str(path)))


def test_a_save_pretrained_directory_loads_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, patch_size=8, image_size=32
    )
    net = transformers.Dinov2Model(config).eval()
    net.save_pretrained(tmp_path / "dino")
    (tmp_path / "dino" / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.5] * 3, "image_std": [0.25] * 3})
    )
    encoder = load_encoder(REPAOptions(encoder=str(tmp_path / "dino"), image_size=32))
    images = torch.rand(2, 3, 32, 32)
    z = encoder(images)
    assert z.shape == (2, 16, 32)
    expected = net(pixel_values=(images - 0.5) / 0.25).last_hidden_state[:, 1:]
    torch.testing.assert_close(z, expected)


def test_a_class_path_loads_its_weights_safely(tmp_path):
    net = DigitsEncoder()
    path = tmp_path / "enc.pt"
    torch.save({"state_dict": net.state_dict()}, path)
    encoder = load_encoder(REPAOptions(encoder="dit_lightning.models.repa.DigitsEncoder", weights=str(path)))
    images = torch.rand(3, 1, 8, 8)
    torch.testing.assert_close(encoder(images), net(images))
    assert not any(p.requires_grad for p in encoder.parameters()) and not encoder.train().training
    torch.save({"code": object()}, tmp_path / "pickled.pt")  # not plain tensors: refused, nothing runs
    with pytest.raises(ValueError, match=r"pickled.pt' names code \((builtins\.)?object\).*: refused"):
        load_encoder(
            REPAOptions(encoder="dit_lightning.models.repa.DigitsEncoder", weights=str(tmp_path / "pickled.pt"))
        )


def test_the_alignment_loss_is_the_mean_negative_cosine_per_token():
    a, b = torch.randn(3, 5, 7), torch.randn(3, 5, 7)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    torch.testing.assert_close(alignment_loss(a, b), -cos.mean(dim=1))
    torch.testing.assert_close(alignment_loss(a, 3 * a), torch.full((3,), -1.0))
    with pytest.raises(ValueError, match="one feature per DiT token"):
        alignment_loss(a, b[:, :4])
