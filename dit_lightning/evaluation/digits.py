"""How recognisable are generated digits? An independent classifier answers with a number.

The classifier is scikit-learn's SVC trained on the real UCI digits (it never sees generated
images); each class is sampled ``per_class`` times and the accuracy per requested class is
reported. ``python -m dit_lightning.evaluation.digits --checkpoint outputs/demo/checkpoints/last.ckpt``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch


def train_digit_classifier(seed: int = 0) -> tuple[Any, float]:
    """An RBF SVC on 90% of the real digits; returns it and its held-out accuracy."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.svm import SVC

    digits = load_digits()
    x, y = digits.data / 16.0, digits.target
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.1, random_state=seed, stratify=y)
    clf = SVC(gamma="scale", C=10.0).fit(x_tr, y_tr)
    return clf, float(clf.score(x_te, y_te))


def pixels_to_features(images: torch.Tensor) -> np.ndarray:
    """Generated (N, 1, H, W) pixels in [-1, 1] -> the classifier's 8x8 features in [0, 1]."""
    x = images.float().clamp(-1, 1)
    if x.shape[-1] != 8:
        x = torch.nn.functional.adaptive_avg_pool2d(x, 8)
    return ((x + 1) / 2).reshape(len(x), -1).cpu().numpy()


def digits_accuracy(
    module, per_class: int = 50, num_steps: int = 100, cfg_scale: Optional[float] = None, seed: int = 0, batch_size: int = 250
) -> dict[str, Any]:
    """Sample ``per_class`` images of every digit and classify them; accuracy overall and per class."""
    clf, real_acc = train_digit_classifier()
    labels = torch.arange(10).repeat_interleave(per_class)
    preds = []
    for start in range(0, len(labels), batch_size):
        chunk = labels[start : start + batch_size]
        latents = module.sample(chunk, num_steps=num_steps, cfg_scale=cfg_scale, seed=seed + start)
        preds.append(clf.predict(pixels_to_features(latents)))
    pred = np.concatenate(preds)
    target = labels.numpy()
    per = {str(c): float((pred[target == c] == c).mean()) for c in range(10)}
    return {
        "accuracy": float((pred == target).mean()),
        "per_class": per,
        "classifier_accuracy_on_real_heldout": real_acc,
        "samples": int(len(labels)),
        "num_steps": num_steps,
        "cfg_scale": module.hparams.cfg_scale if cfg_scale is None else cfg_scale,
    }


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    from ..module import DiTModule

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--per_class", type=int, default=50)
    parser.add_argument("--num_steps", type=int, default=100)
    parser.add_argument("--cfg_scale", type=float, default=None)
    parser.add_argument("--output", default=None, help="JSON file (default: next to the checkpoint's run)")
    args = parser.parse_args(argv)
    module = DiTModule.load_from_checkpoint(args.checkpoint, map_location="cpu", weights_only=True)
    result = digits_accuracy(module, per_class=args.per_class, num_steps=args.num_steps, cfg_scale=args.cfg_scale)
    print(f"classifier on real held-out digits: {result['classifier_accuracy_on_real_heldout']:.1%}")
    print("generated digits recognised as the requested class:")
    print("  " + "  ".join(f"{c}:{a:.0%}" for c, a in result["per_class"].items()))
    print(f"  overall {result['accuracy']:.1%} of {result['samples']} samples")
    out = Path(args.output) if args.output else Path(args.checkpoint).parent.parent / "digits_eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"written to {out}")
    return result


if __name__ == "__main__":
    main()
