"""The VAE between images and latents: pixel stores need none; a diffusers VAE decodes z / scale."""

import pytest
import torch

from dit_lightning.vae import clip_denoised_for, decode_latents, is_pixel_space, load_vae, vae_reference
from tests.helpers.data import make_tiny_vae


def test_pixel_space_stores_decode_without_a_vae_and_clip():
    assert is_pixel_space("none/pixels") and is_pixel_space(None) and not is_pixel_space("stabilityai/sd-vae-ft-ema")
    assert clip_denoised_for("none/pixels") and not clip_denoised_for("stabilityai/sd-vae-ft-mse")
    x = torch.tensor([[[[-1.0, 0.0, 1.0, 3.0]]]])
    assert decode_latents(x, "none/pixels").tolist() == [[[[0.0, 0.5, 1.0, 1.0]]]]


def test_a_saved_vae_decodes_latents_divided_by_the_scale(tmp_path):
    path = make_tiny_vae(str(tmp_path / "vae"))
    vae = load_vae(path)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    z = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    images = decode_latents(z, vae, transform=0.5)
    assert images.shape == (2, 3, 8, 8) and 0 <= float(images.min()) and float(images.max()) <= 1
    with torch.no_grad():
        expect = ((vae.decode(z / 0.5).sample + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(images, expect)
    torch.testing.assert_close(decode_latents(z, path, transform=0.5), expect)  # by path: loaded on the fly


def test_a_missing_vae_says_how_to_get_one(tmp_path):
    with pytest.raises(RuntimeError, match="save_pretrained"):
        load_vae(str(tmp_path / "nowhere"))


def test_a_local_vae_directory_is_recorded_by_its_absolute_path(tmp_path):
    """`extract --vae tiny-vae` recorded the relative name: `sample` from another directory took it
    for a hub id (and retried the hub for a minute)."""
    from dit_lightning.lightning_cli import _store_vae

    (tmp_path / "tiny-vae").mkdir()  # the working directory is tmp_path
    assert vae_reference("tiny-vae") == str(tmp_path / "tiny-vae")
    assert vae_reference("stabilityai/sd-vae-ft-ema") == "stabilityai/sd-vae-ft-ema"  # a hub id, as given
    assert vae_reference("none/pixels") == "none/pixels"
    # a store recorded before: the run's record (the model's vae, in its checkpoints) is made absolute
    store = type("Store", (), {"spec": type("Spec", (), {"vae": "tiny-vae"})()})()
    assert _store_vae(store) == str(tmp_path / "tiny-vae")
