"""Bad checkpoints, and a malicious pickle for every file the project (or a library it calls)
unpickles: each is refused with one message that says what the file is, and no code from it runs
(the pickles would create a marker file when unpickled; it must never appear).

Files unpickled and what guards them:
- checkpoints of every format, read by every command (``sample``, ``export``, ``consolidate``,
  ``prune``, ``evaluate``, ``verify``, ``--ckpt_path``, ``--model.init_from``, a teacher):
  ``torch.load(weights_only=True)`` (``checkpoints.safe_load.load_file``, under ``read_checkpoint``
  and ``read_training_state``);
- a sharded checkpoint's ``.metadata``, which torch.distributed.checkpoint reads with plain
  ``pickle.load``: vetted by a restricted unpickler first (checkpoints/safe_load.py);
- the InceptionV3 weights of FID / IS / KID: tests/evaluation/test_inception.py;
- a VAE directory's ``diffusion_pytorch_model.bin``: diffusers' loader (weights only);
- ``.npz`` references and statistics: numpy without ``allow_pickle``, checked up front.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.cli import DEMO, TINY
from tests.helpers.data import make_image_folder, make_tiny_vae
from tests.reliability.conftest import call, one_message

pytestmark = pytest.mark.usefixtures("one_thread")


class Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): code from a data file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "PWNED"


@pytest.fixture
def bad_files(tmp_path, marker, trained) -> dict[str, Path]:
    files = {}
    files["empty"] = tmp_path / "empty.ckpt"
    files["empty"].write_bytes(b"")
    files["random bytes"] = tmp_path / "random.ckpt"
    files["random bytes"].write_bytes(np.random.default_rng(0).bytes(5000))
    files["truncated"] = tmp_path / "truncated.ckpt"
    files["truncated"].write_bytes(trained.read_bytes()[:100_000])
    ckpt = torch.load(trained, weights_only=True)
    ckpt["state_dict"]["model.pos_embed"] = Payload(marker)  # a checkpoint that runs code when unpickled
    files["malicious"] = tmp_path / "malicious.ckpt"
    torch.save(ckpt, files["malicious"])
    files["malicious plain pickle"] = tmp_path / "malicious.pkl"
    files["malicious plain pickle"].write_bytes(pickle.dumps({"model": Payload(marker)}))
    return files


MESSAGES = {
    "empty": "is empty (0 bytes)",
    "random bytes": "is not a PyTorch checkpoint that holds only tensors",
    "truncated": "is truncated or corrupt",
    "malicious": "that unpickling it would run: refused",
    "malicious plain pickle": "is not a PyTorch checkpoint that holds only tensors",
}


def _commands(path: Path, out: Path, digits: Path) -> dict[str, list[str]]:
    fit = ["fit", "--config", DEMO, *TINY, "--data.path", str(digits)]
    return {
        "sample": ["sample", "--checkpoint", str(path), "--output", str(out / "s"), "--num_samples", "1"],
        "export": ["export", "--checkpoint", str(path), "--output", str(out / "e.pt")],
        "consolidate": ["consolidate", "--checkpoint", str(path), "--output", str(out / "c.pt")],
        "prune": ["prune", "--checkpoint", str(path), "--output", str(out / "p.pt"), "--depth", "1"],
        "evaluate": ["evaluate", "--checkpoint", str(path), "--output", str(out / "v"), "--metrics", "digits"],
        "verify": ["verify", "--path", str(path)],
        "validate --ckpt_path": ["validate", *fit[1:], "--ckpt_path", str(path)],
        "fit --model.init_from": [*fit, "--model.init_from", str(path)],
        "distillation teacher": [
            *fit,
            "--model.class_path",
            "dit_lightning.distill.DistillationModule",
            "--model.init_args.teacher",
            str(path),
        ],  # fmt: skip
    }


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_every_reader_refuses_a_bad_checkpoint_with_one_message(kind, bad_files, marker, digits, tmp_path, capsys):
    path = bad_files[kind]
    for name, args in _commands(path, tmp_path / "out", digits).items():
        code, _, err = call(args, capsys)
        assert code == 1, (name, err)
        assert MESSAGES[kind] in err and "weights_only=False" not in err and "EOFError" not in err, (name, err)
        one_message(err)
        assert not marker.exists(), f"{name} ran code from {kind}"
    assert not (tmp_path / "out" / "e.pt").exists() and not (tmp_path / "out" / "p.pt").exists()


def test_a_sharded_checkpoint_whose_metadata_runs_code_is_refused(trained, marker, digits, tmp_path, capsys):
    """torch.distributed.checkpoint unpickles ``.metadata`` with plain pickle: a directory built to
    run code when read is refused before torch (or Lightning, resuming) opens it."""
    import torch.distributed.checkpoint as dcp

    good = tmp_path / "sharded.ckpt"
    state = torch.load(trained, weights_only=True)
    with pytest.warns(UserWarning):  # torch: "assuming the intent is to save in a single process"
        dcp.save({"state_dict": state["state_dict"]}, checkpoint_id=str(good), no_dist=True)
    from dit_lightning.checkpoints.safe_load import check_dcp_metadata

    check_dcp_metadata(good)  # what torch writes passes
    evil = Path(shutil.copytree(good, tmp_path / "evil.ckpt"))
    (evil / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    commands = _commands(evil, tmp_path / "out", digits)
    for name in ("sample", "consolidate", "export", "validate --ckpt_path", "fit --model.init_from"):
        code, _, err = call(commands[name], capsys)
        assert code == 1 and "naming code (" in err and "open)" in err and "refused" in err, (name, err)
        assert not marker.exists(), name


def test_a_vae_whose_weights_run_code_is_refused(marker, tmp_path, capsys):
    vae = Path(make_tiny_vae(str(tmp_path / "vae")))
    for f in vae.glob("diffusion_pytorch_model.*"):
        f.unlink()
    torch.save({"encoder.conv_in.weight": Payload(marker)}, vae / "diffusion_pytorch_model.bin")
    make_image_folder(str(tmp_path / "images"), with_bad=False)
    code, _, err = call(
        ["extract", "--image_root", str(tmp_path / "images"), "--output", str(tmp_path / "latents"), "--vae", str(vae),
         "--image_size", "32", "--num_workers", "0"],
        capsys,
    )  # fmt: skip
    assert code == 1 and "is not a plain weights file" in err and "safetensors" in err and not marker.exists(), err


def test_an_npz_reference_holding_pickles_is_refused_before_sampling(trained, marker, tmp_path, capsys):
    evil = tmp_path / "reference.npz"
    np.savez(evil, mu=np.zeros(3), sigma=np.array([Payload(marker)], dtype=object))
    out = tmp_path / "eval"
    code, _, err = call(
        ["evaluate", "--checkpoint", str(trained), "--output", str(out), "--metrics", "fid", "--reference", str(evil),
         "--num_samples", "4"],
        capsys,
    )  # fmt: skip
    assert code == 1 and "holds pickled objects" in err and not (out / "samples").exists(), err
    assert not marker.exists()
    from dit_lightning.evaluation.fid import FeatureStats, check_plain_npz

    with pytest.raises(ValueError, match="holds pickled objects"):
        check_plain_npz(evil)
    with pytest.raises(ValueError, match="pickled objects are never loaded"):
        FeatureStats.load(evil)
    assert not marker.exists() and not os.path.exists(out / "metrics.json")
