"""The InceptionV3 of FID / IS / KID: its weights file is checked before any third-party code
unpickles it, it computes what torchmetrics' extractor computes, and FID from statistics equals
torchmetrics' FrechetInceptionDistance."""

import hashlib
import os
import pickle
from unittest import mock

import numpy as np
import pytest
import torch

from dit_lightning.evaluation.fid import FeatureStats, InceptionFeatures, _Columns, metrics_from_features


def _random_inception_state() -> dict:
    """The state dict of torch-fidelity's InceptionV3 with its random initialisation (no download)."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    with (
        mock.patch("torch_fidelity.feature_extractor_inceptionv3.torch.load", return_value={}),
        mock.patch.object(FeatureExtractorInceptionV3, "load_state_dict"),
    ):
        torch.manual_seed(0)
        net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path="unused")
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    """A weights file named like the published one, with the hash of its own content."""
    d = tmp_path_factory.mktemp("inception")
    tmp = d / "w.pth"
    torch.save(_random_inception_state(), tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()[:8]
    path = d / f"weights-inception-2015-12-05-{digest}.pth"
    tmp.rename(path)
    return str(path)


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['MARKER']}",))


def test_a_tampered_weights_file_runs_no_code(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("MARKER", str(marker))
    evil = tmp_path / "weights-inception.pth"
    with open(evil, "wb") as f:
        pickle.dump({"fc.weight": _RunsCode()}, f)
    with pytest.raises(ValueError, match="not loaded") as e:
        InceptionFeatures(str(evil))
    assert str(evil) in str(e.value) and "weights_only=False" not in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


def test_a_file_of_other_tensors_is_refused_in_one_line_naming_it(tmp_path):
    """torch-fidelity's strict load listed every one of the 566 missing keys (17 kB), after sampling."""
    other = tmp_path / "inception.pth"
    torch.save({"conv.weight": torch.zeros(3, 3), "fc.weight": torch.zeros(2)}, other)
    with pytest.raises(ValueError) as e:
        InceptionFeatures(str(other))
    message = str(e.value)
    assert message.startswith(f"the InceptionV3 weights file {other} is not the InceptionV3 of FID"), message
    assert "missing 565 (e.g. 'Conv2d_1a_3x3.conv.weight')" in message and "of another shape 1" in message
    assert "wget https://" in message and "\n" not in message and len(message) < 600


def test_a_file_whose_content_does_not_match_the_hash_in_its_name_is_refused(weights, tmp_path):
    wrong = tmp_path / "weights-inception-2015-12-05-6726825d.pth"
    wrong.write_bytes(open(weights, "rb").read())
    with pytest.raises(ValueError, match="does not match the hash in its name"):
        InceptionFeatures(str(wrong))


def test_features_equal_torchmetrics_extractor_in_one_forward(weights):
    from torchmetrics.image.fid import NoTrainInceptionV3

    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ours = InceptionFeatures(weights, logits=True)
    feats = ours(images)
    assert feats.shape == (2, 2048 + 1008) and ours.num_features == 2048 + 1008
    reference = NoTrainInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=weights)
    torch.testing.assert_close(feats[:, :2048], reference(images).reshape(2, -1), rtol=1e-5, atol=1e-5)
    assert InceptionFeatures(weights)(images).shape == (2, 2048)


def test_fid_from_statistics_equals_torchmetrics_fid():
    from torchmetrics.image.fid import FrechetInceptionDistance

    g = np.random.default_rng(0)
    real = g.standard_normal((300, 8)) @ g.standard_normal((8, 8))
    fake = g.standard_normal((200, 8)) * 1.3 + 0.4
    metric = FrechetInceptionDistance(feature=_Columns(0, 8))
    metric.update(torch.from_numpy(real).double(), real=True)
    metric.update(torch.from_numpy(fake).double(), real=False)
    ours = metrics_from_features(fake, ["fid"], FeatureStats.from_features(real))["fid"]
    assert ours == pytest.approx(float(metric.compute()), rel=1e-6)
    assert ours > 0.5
