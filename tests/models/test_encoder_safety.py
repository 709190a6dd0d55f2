"""No code runs from anything a REPA encoder is loaded from, and every refusal names the file and the fix:

- a transformers directory whose ``config.json`` maps to custom code (``auto_map``) is refused up front,
  even when the user would answer "y" to transformers' prompt, and transformers is always called with
  ``trust_remote_code=False``;
- a class path read from a file (``trusted=False``) is checked against the allowlist before anything
  is imported; deciding whether a name is a class path imports nothing;
- weights files are read weights-only (safetensors preferred): a pickle naming code, an empty or
  truncated file and the weights of another network are each refused in one message naming the file;
- a class-path encoder without weights is refused unless its class declares ``needs_weights = False``;
- ``EncoderIdentity.of`` identifies the weights a run used (``extract`` records the same hash).

The marker file ``PWNED`` would be created by the code of the directory, module or pickle.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dit_lightning.hashing import file_sha256, tree_sha256
from dit_lightning.models import encoders
from dit_lightning.models.encoders import load_encoder, resolve_encoder_class
from dit_lightning.models.repa import DigitsEncoder, REPAOptions
from dit_lightning.models.repa_head import EncoderIdentity
from dit_lightning.safe_read import TRUSTED_CLASSES_ENV, UnsafeFileError, UntrustedClassError

pytestmark = pytest.mark.usefixtures("one_thread")
DIGITS = "dit_lightning.models.repa.DigitsEncoder"


class FixedEncoder(nn.Module):
    """A class-path encoder that declares it needs no weights file (its features are fixed)."""

    needs_weights = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.flatten(2).transpose(1, 2)


class Exec:
    """Unpickling this calls ``builtins.exec`` on code that creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.code = f"open({str(marker)!r}, 'w').close()"

    def __reduce__(self):
        return (exec, (self.code,))


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "PWNED"


def _tiny_dinov2(path: Path, classifier: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, patch_size=8, image_size=32
    )
    net = (transformers.Dinov2ForImageClassification if classifier else transformers.Dinov2Model)(config).eval()
    net.save_pretrained(path)
    return net


def _custom_code_directory(root: Path, marker: Path) -> Path:
    """A save_pretrained-like directory whose config maps to Python files that create ``marker``."""
    d = root / "custom"
    d.mkdir()
    auto_map = {"AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel"}
    (d / "config.json").write_text(json.dumps({"model_type": "custom", "auto_map": auto_map}))
    run = f"open({str(marker)!r}, 'w').close()\n"
    (d / "configuration_custom.py").write_text(
        run + "from transformers import PretrainedConfig\n\n\nclass CustomConfig(PretrainedConfig):\n"
        "    model_type = 'custom'\n"
    )
    (d / "modeling_custom.py").write_text(
        run + "from transformers import PreTrainedModel\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomModel(PreTrainedModel):\n    config_class = CustomConfig\n"
    )
    return d


@pytest.mark.parametrize("trusted", [True, False])
def test_a_directory_of_custom_code_is_refused_even_answering_yes(tmp_path, marker, monkeypatch, trusted):
    from transformers import dynamic_module_utils

    directory = _custom_code_directory(tmp_path, marker)
    monkeypatch.setattr("builtins.input", lambda *_: "y")  # the user (or `yes |`) answers transformers' prompt
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # were it copied
    with pytest.raises(ValueError) as raised:
        load_encoder(REPAOptions(encoder=str(directory)), trusted=trusted)
    message = str(raised.value)
    assert str(directory) in message and "auto_map" in message and "never run" in message, message
    assert "trust_remote_code=True" not in message
    assert not marker.exists(), "the directory's Python ran"


def test_transformers_is_called_with_remote_code_off(tmp_path, monkeypatch):
    import transformers

    net = _tiny_dinov2(tmp_path / "dino")
    seen: list[object] = []
    real = transformers.AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code", "unset"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    encoder = load_encoder(REPAOptions(encoder=str(tmp_path / "dino"), image_size=32))
    assert seen == [False]
    images = torch.rand(2, 3, 32, 32)
    mean, std = (
        torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1),
        torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1),
    )
    expected = net(pixel_values=(images - mean) / std).last_hidden_state[:, 1:]
    torch.testing.assert_close(encoder(images), expected)


def test_a_directory_of_a_classifier_loads_its_backbone_and_a_wrong_one_is_named(tmp_path):
    net = _tiny_dinov2(tmp_path / "cls", classifier=True)
    encoder = load_encoder(REPAOptions(encoder=str(tmp_path / "cls"), image_size=32))
    images = torch.rand(1, 3, 32, 32)
    mean, std = (
        torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1),
        torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1),
    )
    torch.testing.assert_close(encoder(images), net.dinov2(pixel_values=(images - mean) / std).last_hidden_state[:, 1:])
    # the weights of another network under this config: named with the file and the fix
    weights = tmp_path / "cls" / "model.safetensors"
    save_file({"something.else": torch.zeros(3)}, str(weights))
    with pytest.raises(ValueError, match=r"does not fit .*missing.*embeddings") as raised:
        load_encoder(REPAOptions(encoder=str(tmp_path / "cls"), image_size=32))
    assert str(weights) in str(raised.value)


def test_a_pickled_weights_file_in_a_directory_is_refused_without_running_it(tmp_path, marker):
    _tiny_dinov2(tmp_path / "dino")
    (tmp_path / "dino" / "model.safetensors").unlink()
    torch.save({"embeddings.cls_token": Exec(marker)}, tmp_path / "dino" / "pytorch_model.bin")
    with pytest.raises(UnsafeFileError, match=r"names code \((builtins\.)?exec\).*refused") as raised:
        load_encoder(REPAOptions(encoder=str(tmp_path / "dino")), trusted=False)
    assert str(tmp_path / "dino" / "pytorch_model.bin") in str(raised.value)
    assert not marker.exists()


@pytest.fixture
def marker_module(tmp_path, marker, monkeypatch) -> Iterator[str]:
    """A module on sys.path whose import creates the marker; it defines ``Zen``, an encoder class."""
    name = "repa_marker_module_x"
    (tmp_path / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom torch import nn\n\n\nclass Zen(nn.Identity):\n"
        "    needs_weights = False\n\n    def forward(self, x):\n        return x.flatten(2).transpose(1, 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


def test_a_class_path_read_from_a_file_is_checked_before_anything_is_imported(marker_module, marker, monkeypatch):
    name = f"{marker_module}.Zen"
    assert encoders._is_class_path(name)  # decided from the name: nothing imported
    assert not marker.exists() and marker_module not in sys.modules
    with pytest.raises(UntrustedClassError) as raised:
        load_encoder(REPAOptions(encoder=name), trusted=False)
    message = str(raised.value)
    assert name in message and "refused" in message and f"{TRUSTED_CLASSES_ENV}={marker_module}" in message, message
    assert not marker.exists() and marker_module not in sys.modules
    with pytest.raises(UntrustedClassError):
        resolve_encoder_class("os.system", trusted=False)
    # the project's own classes are allowed; a typed class path (or a trusted prefix) is the user's choice
    assert resolve_encoder_class(DIGITS, trusted=False) is DigitsEncoder
    monkeypatch.setenv(TRUSTED_CLASSES_ENV, f"{marker_module}_other, {marker_module}")
    assert resolve_encoder_class(name, trusted=False).__name__ == "Zen" and marker.exists()


def test_a_class_path_typed_by_the_user_is_imported(marker_module, marker):
    encoder = load_encoder(REPAOptions(encoder=f"{marker_module}.Zen"), trusted=True)  # needs_weights = False
    assert marker.exists() and encoder(torch.rand(2, 1, 4, 4)).shape == (2, 16, 1)


def test_dotted_timm_names_are_timm_names_not_class_paths(tmp_path, marker_module, marker):
    timm = pytest.importorskip("timm")
    assert not encoders._is_class_path("vit_base_patch14_dinov2.lvd142m")
    net = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=0)
    torch.save(net.state_dict(), tmp_path / "vit.pth")
    options = REPAOptions(encoder="vit_tiny_patch16_224.augreg_in21k", weights=str(tmp_path / "vit.pth"), image_size=32)
    assert load_encoder(options, trusted=False)(torch.rand(1, 3, 32, 32)).shape == (1, 4, 192)
    with pytest.raises(ValueError, match="not a timm model name") as raised:  # hub names are not downloaded
        load_encoder(REPAOptions(encoder="hf-hub:timm/vit_tiny", weights=str(tmp_path / "vit.pth")), trusted=False)
    assert "directory or class path" in str(raised.value)
    wrong = tmp_path / "digits.pt"
    torch.save(DigitsEncoder().state_dict(), wrong)
    with pytest.raises(ValueError, match="does not fit timm's vit_tiny_patch16_224") as raised:
        load_encoder(REPAOptions(encoder="vit_tiny_patch16_224", weights=str(wrong), image_size=32))
    assert str(wrong) in str(raised.value) and "pass the weights of timm's vit_tiny_patch16_224" in str(raised.value)
    assert not marker.exists()


def test_weights_files_are_read_weights_only_and_named_in_every_error(tmp_path, marker):
    net = DigitsEncoder()
    files = {name: tmp_path / name for name in ("enc.safetensors", "enc.pt", "exec.pt", "cut.pt", "cut.safetensors")}
    save_file(net.state_dict(), str(files["enc.safetensors"]))
    torch.save({"model": net.state_dict()}, files["enc.pt"])
    torch.save({"w": Exec(marker)}, files["exec.pt"])
    files["cut.pt"].write_bytes(files["enc.pt"].read_bytes()[:4000])
    files["cut.safetensors"].write_bytes(files["enc.safetensors"].read_bytes()[:4000])
    (tmp_path / "empty.pt").write_bytes(b"")
    images = torch.rand(2, 1, 8, 8)
    for good in ("enc.safetensors", "enc.pt"):  # safetensors, and a state dict under "model"
        torch.testing.assert_close(
            load_encoder(REPAOptions(encoder=DIGITS, weights=str(files[good])))(images), net(images)
        )
    expected = {
        "exec.pt": r"names code \((builtins\.)?exec\) that unpickling it would run: refused",
        "cut.pt": "is truncated or corrupt.*again",
        "cut.safetensors": "is truncated or corrupt.*again",
        "empty.pt": r"is empty \(0 bytes\)",
        "missing.pt": "does not exist",
    }
    for name, pattern in expected.items():
        path = tmp_path / name
        with pytest.raises((ValueError, FileNotFoundError), match=pattern) as raised:
            load_encoder(REPAOptions(encoder=DIGITS, weights=str(path)), trusted=False)
        message = str(raised.value)
        assert str(path) in message and "weights_only=False" not in message and "Weights only load" not in message
    assert not marker.exists()
    other = tmp_path / "other.pt"
    torch.save(DigitsEncoder(width=32).state_dict(), other)  # another network
    with pytest.raises(ValueError, match=f"{other}.* does not fit {DIGITS}.*shape") as raised:
        load_encoder(REPAOptions(encoder=DIGITS, weights=str(other)))
    torch.save(torch.zeros(3), other)  # not a state dict at all
    with pytest.raises(ValueError, match=f"{other}.*holds a Tensor, not a state dict"):
        load_encoder(REPAOptions(encoder=DIGITS, weights=str(other)))


def test_a_class_path_without_weights_is_refused_unless_its_class_needs_none(tmp_path):
    with pytest.raises(ValueError, match="model.repa.weights.*random.*needs_weights = False"):
        load_encoder(REPAOptions(encoder=DIGITS))
    encoder = load_encoder(REPAOptions(encoder=f"{__name__}.FixedEncoder"))
    assert encoder(torch.rand(2, 1, 4, 4)).shape == (2, 16, 1)


def test_the_weights_hash_is_the_files_or_the_directorys(tmp_path):
    def sha(options: REPAOptions):
        return EncoderIdentity.of(options).weights_sha256

    torch.save(DigitsEncoder().state_dict(), tmp_path / "enc.pt")
    _tiny_dinov2(tmp_path / "dino")
    assert sha(REPAOptions(encoder=DIGITS, weights=str(tmp_path / "enc.pt"))) == file_sha256(str(tmp_path / "enc.pt"))
    assert sha(REPAOptions(encoder=str(tmp_path / "dino"))) == tree_sha256(str(tmp_path / "dino"))
    assert sha(REPAOptions(encoder=f"{__name__}.FixedEncoder")) is None
    assert sha(REPAOptions()) is None
