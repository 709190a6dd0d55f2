"""How good are generated digits? An independent classifier and a Fréchet distance answer.

The classifier is scikit-learn's SVC trained on the real UCI digits (it never sees generated
images); each class is sampled ``per_class`` times and the accuracy per requested class is
reported. Quality beyond recognisability is an FID-like number computed offline (no Inception):
the Fréchet distance between Gaussians fitted to real and generated digits, in the raw 64-d
pixel space and in the SVC's 10-d decision-function space, next to the same distance between
two disjoint sets of *real* digits of the same size (the finite-sample floor a perfect model
would reach). ``dit-lightning test --config configs/demo.yaml --ckpt_path outputs/demo/last.ckpt``
reports them (``GenerationMetrics`` with ``metrics: [digits]``); ``dit-lightning evaluate --metrics
'[digits]'`` measures a sample folder.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..data.digits import DIGITS_NUM_CLASSES, DIGITS_SOURCE, DIGITS_VAE, load_uci_digits
from ..images import existing_samples, load_png_rgb, sample_labels
from .fid import frechet_distance


def digits_data_mismatch(spec: Any) -> Optional[str]:
    """Why the digits metrics cannot score a model trained on the store ``spec`` (a ``StoreSpec``)
    describes, or None for the bundled digits store (``prepare-digits``, ``data.prepare: digits``, any
    size): the classifier and the reference are the 8x8 UCI digits, and other images, MNIST included,
    would be scored against them (real MNIST itself scores an accuracy of 0.14)."""
    shape = tuple(spec.latent_shape)
    if (
        spec.source == DIGITS_SOURCE
        and spec.vae == DIGITS_VAE
        and len(shape) == 3
        and shape[0] == 1
        and shape[1] == shape[2]
        and shape[1] % 8 == 0
        and len(spec.class_names) == DIGITS_NUM_CLASSES
    ):
        return None
    size = "x".join(str(int(d)) for d in shape)
    return f"the store holds {spec.source or 'images of another source'} ({size}, {len(spec.class_names)} classes)"


def train_digit_classifier(seed: int = 0) -> tuple[Any, float]:
    """An RBF SVC on 90% of the real digits; returns it and its held-out accuracy."""
    images, y = load_uci_digits()
    from sklearn.model_selection import train_test_split
    from sklearn.svm import SVC

    x = images.reshape(len(images), -1) / 16.0
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.1, random_state=seed, stratify=y)
    clf = SVC(gamma="scale", C=10.0).fit(x_tr, y_tr)
    return clf, float(clf.score(x_te, y_te))


def pixels_to_features(images: torch.Tensor) -> np.ndarray:
    """Generated (N, 1, H, W) pixels in [-1, 1] -> the classifier's 8x8 features in [0, 1]."""
    x = images.float().clamp(-1, 1)
    if x.shape[-1] != 8:
        x = torch.nn.functional.adaptive_avg_pool2d(x, 8)
    return ((x + 1) / 2).reshape(len(x), -1).cpu().numpy()


def uint8_digit_features(images: torch.Tensor) -> np.ndarray:
    """8-bit generated digits (N, 1, H, W), as written to PNGs -> the classifier's features."""
    return pixels_to_features(images.float() / 255 * 2 - 1)


def _real_digit_features() -> np.ndarray:
    images, _ = load_uci_digits()
    return images.reshape(len(images), -1) / 16.0  # (1797, 64) in [0, 1], the classifier's input space


def digits_frechet(generated: np.ndarray, clf: Any = None, seed: int = 0) -> dict[str, Any]:
    """Fréchet distances of generated digits (N, 64) in [0, 1] to real digits, and the floor.

    The real digits are split in two fixed halves: A is the reference, and a subset of B of
    the generated set's size (at most |B|) gives the baseline distance of real data to A.
    """
    real = _real_digit_features()
    perm = np.random.default_rng(seed).permutation(len(real))
    ref, other = real[perm[: len(real) // 2]], real[perm[len(real) // 2 :]]
    baseline = other[: min(len(generated), len(other))]
    if clf is None:
        clf, _ = train_digit_classifier(seed)

    def fd(a: np.ndarray, b: np.ndarray) -> float:
        return frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))

    space = {"pixels": lambda x: x, "svc": lambda x: clf.decision_function(x)}
    out: dict[str, Any] = {"reference_size": int(len(ref)), "baseline_size": int(len(baseline))}
    for name, f in space.items():
        r = f(ref)
        out[f"fd_{name}"] = fd(f(generated), r)
        out[f"fd_{name}_real_baseline"] = fd(f(baseline), r)
    return out


def digits_metrics(
    features: np.ndarray, labels: np.ndarray, clf: Any = None, real_acc: Optional[float] = None
) -> dict[str, Any]:
    """Accuracy of the classifier on generated digits (N, 64) in [0, 1] with requested
    ``labels``, per class, and the Fréchet distances of :func:`digits_frechet`."""
    if clf is None:
        clf, real_acc = train_digit_classifier()
    pred = clf.predict(features)
    target = np.asarray(labels)
    classes = sorted(set(target.tolist()))
    return {
        "accuracy": float((pred == target).mean()),
        "per_class": {str(c): float((pred[target == c] == c).mean()) for c in classes},
        "classifier_accuracy_on_real_heldout": real_acc,
        "samples": int(len(target)),
        "frechet": digits_frechet(features, clf),
    }


def digits_metrics_from_samples(samples_dir: str, limit: Optional[int] = None) -> dict[str, Any]:
    """:func:`digits_metrics` of a ``dit-lightning sample`` output (labels from the file names)."""
    found = existing_samples(samples_dir)
    indices = sorted(found)[:limit]
    if not indices:
        raise FileNotFoundError(f"no sample PNGs in {samples_dir}")
    images = torch.from_numpy(np.stack([load_png_rgb(found[i])[..., 0] for i in indices]))[
        :, None
    ]  # uint8 (N, 1, H, W)
    labels = sample_labels([found[i] for i in indices])
    return digits_metrics(uint8_digit_features(images), labels)


def digits_accuracy(
    module: Any,
    per_class: int = 50,
    num_steps: int = 100,
    cfg_scale: Optional[float] = None,
    seed: int = 0,
    batch_size: int = 250,
) -> dict[str, Any]:
    """Sample ``per_class`` images of every digit and classify them; accuracy overall and per class."""
    clf, real_acc = train_digit_classifier()
    labels = torch.arange(10).repeat_interleave(per_class)
    feats = []
    for start in range(0, len(labels), batch_size):
        chunk = labels[start : start + batch_size]
        latents = module.sample(chunk, num_steps=num_steps, cfg_scale=cfg_scale, seed=seed + start)
        feats.append(pixels_to_features(latents))
    result = digits_metrics(np.concatenate(feats), labels.numpy(), clf, real_acc)
    result["num_steps"] = num_steps
    result["cfg_scale"] = module.hparams.cfg_scale if cfg_scale is None else cfg_scale
    return result
