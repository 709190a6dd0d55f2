"""The digits demo's metrics: Frechet distances and classifier accuracy on real digits."""

import numpy as np


def test_digits_frechet_distance_and_accuracy_on_real_digits():
    from sklearn.datasets import load_digits

    from dit_lightning.evaluation.digits import digits_frechet, digits_metrics

    d = load_digits()
    x, y = d.data / 16.0, d.target
    pick = np.random.default_rng(1).permutation(len(x))[:300]
    real = digits_metrics(x[pick], y[pick])
    assert real["accuracy"] > 0.95
    fr = real["frechet"]
    # real digits sit near the finite-sample floor; noise and blur move away from it
    assert fr["fd_pixels"] < 2 * fr["fd_pixels_real_baseline"] + 0.1
    noisy = digits_frechet(np.clip(x[pick] + np.random.default_rng(0).normal(0, 0.3, x[pick].shape), 0, 1))
    assert noisy["fd_pixels"] > 3 * fr["fd_pixels"] and noisy["fd_svc"] > fr["fd_svc"]


def test_the_digits_metrics_know_the_store_they_were_made_for():
    """Only the bundled digits (any size prepare-digits makes) are scored: a 1-channel, 10-class pixel
    store of other images (MNIST) would be judged by the 8x8 digits' classifier and reference."""
    import dataclasses

    from dit_lightning.data.digits import digits_spec
    from dit_lightning.evaluation.digits import digits_data_mismatch

    assert digits_data_mismatch(digits_spec(8)) is None and digits_data_mismatch(digits_spec(16)) is None
    mnist = dataclasses.replace(digits_spec(8), source="/data/mnist/train", latent_shape=(1, 28, 28))
    assert digits_data_mismatch(mnist) == "the store holds /data/mnist/train (1x28x28, 10 classes)"
    latents = dataclasses.replace(digits_spec(8), vae="stabilityai/sd-vae-ft-ema", latent_shape=(4, 8, 8))
    assert digits_data_mismatch(latents) is not None
