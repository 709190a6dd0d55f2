"""Counter-based randomness: pure in (seed, epoch, index), Gaussian, vectorised."""

from __future__ import annotations

import numpy as np
import pytest

from dit_lightning.data.rng import NoiseKernel, flip_bits, mix64_int, sample_keys, to_float32


def test_mix64_matches_reference_values():
    # splitmix64 with state 0: the first outputs of the reference generator
    g = 0x9E3779B97F4A7C15
    assert mix64_int(g) == 0xE220A8397B1DCDAF
    assert mix64_int(2 * g) == 0x6E789E6AA1B965F4


@pytest.mark.parametrize("E", [4096, 7, 1])
def test_noise_is_a_function_of_seed_epoch_index(E):
    k = NoiseKernel(E, chunk_pairs=64)  # tiny chunks: exercises the chunk loop
    idx = np.array([5, 3, 1000, 7, 42])
    a = k.normal(0, 1, idx)
    b = NoiseKernel(E).normal(0, 1, idx[::-1])[::-1]  # other order, other chunking
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[2], k.normal(0, 1, np.array([1000]))[0])
    assert not np.allclose(a, k.normal(0, 2, idx))  # other epoch
    assert not np.allclose(a, k.normal(1, 1, idx))  # other seed
    assert a.shape == (5, E) and a.dtype == np.float32


def test_noise_statistics():
    e = NoiseKernel(1024).normal(3, 0, np.arange(512)).ravel()
    assert abs(e.mean()) < 0.01 and abs(e.std() - 1) < 0.01
    assert abs(np.mean(e**4) - 3) < 0.05  # Gaussian kurtosis
    assert np.isfinite(e).all() and np.abs(e).max() < 6
    # neighbouring samples are uncorrelated
    m = NoiseKernel(1024).normal(3, 0, np.arange(64))
    c = np.corrcoef(m)
    assert np.abs(c[~np.eye(64, dtype=bool)]).max() < 0.15
    f = flip_bits(0, 0, np.arange(20000))
    assert set(np.unique(f)) == {0, 1} and abs(f.mean() - 0.5) < 0.02
    assert not np.array_equal(f, flip_bits(0, 1, np.arange(20000)))


def test_posterior_sample_formula_and_dtypes():
    rng = np.random.default_rng(0)
    mean = rng.standard_normal((6, 50)).astype(np.float16)
    logvar = (rng.standard_normal((6, 50)) - 2).astype(np.float16)
    idx = np.arange(10, 16)
    k = NoiseKernel(50, chunk_pairs=50)
    z = k.posterior_sample(mean, logvar, 4, 2, idx, 0.5)
    eps = k.normal(4, 2, idx)
    ref = (mean.astype(np.float32) + np.exp(0.5 * logvar.astype(np.float32)) * eps) * 0.5
    np.testing.assert_allclose(z, ref, rtol=1e-5, atol=1e-6)
    assert len(set(sample_keys(0, 0, np.arange(1000)).tolist())) == 1000


def test_to_float32_strided_and_readonly():
    a = np.arange(24, dtype=np.float16).reshape(4, 2, 3)
    np.testing.assert_array_equal(to_float32(a[:, 0]), a[:, 0].astype(np.float32))
    ro = a.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(to_float32(ro), a.astype(np.float32))
