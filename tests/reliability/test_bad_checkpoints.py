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
    assert code == 1 and "that unpickling it would run: refused" in err and "safetensors" in err, err
    assert "weights_only" not in err and not marker.exists(), err


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


# ---- non-finite weights, and the weights files that are not checkpoints ------------------------


def _first_line(err: str) -> str:
    """The first line of the error message (progress lines may come before it)."""
    return next(line for line in err.splitlines() if ": error: " in line)


def test_every_reader_refuses_non_finite_weights_naming_the_file_and_the_tensor(trained, digits, tmp_path, capsys):
    """`sample` wrote black images with exit 0; `fit --model.init_from` stopped at step 1 blaming the
    store or the learning rate. Every reader of weights refuses them before any work, in one line."""
    ckpt = torch.load(trained, weights_only=True)
    for prefix in ("model.", "ema."):  # a run that diverged: both sets hold the NaN
        ckpt["state_dict"][prefix + "blocks.1.attn.qkv.weight"][0, 0] = float("nan")
    diverged = tmp_path / "diverged.ckpt"
    torch.save(ckpt, diverged)
    out = tmp_path / "out"
    for name, args in _commands(diverged, out, digits).items():
        code, _, err = call(args, capsys)
        assert code == 1, (name, err)
        one_message(err)
        if name == "verify":  # the one reader that reads them, to report them
            assert "the ema weights hold NaN or inf in 1 tensors (e.g. blocks.1.attn.qkv.weight)" in err, err
            continue
        line = _first_line(err)
        assert f"'{diverged}' holds NaN/inf in its EMA weights and trained weights" in line, (name, err)
        assert "tensor 'blocks.1.attn.qkv.weight'" in line and "Use an earlier checkpoint" in line, (name, err)
    assert not out.exists() or not any(out.rglob("*.png")) and not any(out.rglob("*.pt"))


def test_check_finite_names_the_weight_set(tmp_path):
    from dit_lightning.checkpoints import NonFiniteWeightsError, read_checkpoint
    from dit_lightning.checkpoints.export import save_dit
    from tests.helpers.models import random_dit

    model, ema = random_dit(seed=0), random_dit(seed=1)
    with torch.no_grad():
        ema.final_layer.linear.bias[1] = float("inf")
    path = tmp_path / "ref.pt"
    save_dit(model, path, ema=ema)
    with pytest.raises(NonFiniteWeightsError, match=r"in its EMA weights \(tensor 'final_layer.linear.bias'\)"):
        read_checkpoint(path)
    assert read_checkpoint(path, finite=False).ema is not None  # `verify` reads it to report it


def test_a_pickled_bin_in_a_diffusers_directory_is_refused_by_the_project(trained, marker, tmp_path, capsys):
    """Diffusers directories may hold pickled weights (.bin): the transformer's and the VAE's are read
    weights-only and refused with the project's one line, never torch's paragraph on weights_only."""
    pipe = tmp_path / "pipe"
    code, _, err = call(
        ["export", "--checkpoint", str(trained), "--output", str(pipe), "--format", "diffusers"], capsys
    )
    assert code == 0, err
    evil = Path(shutil.copytree(pipe, tmp_path / "evil-transformer"))
    for f in (evil / "transformer").glob("diffusion_pytorch_model.*"):
        f.unlink()
    torch.save({"pos_embed": Payload(marker)}, evil / "transformer" / "diffusion_pytorch_model.bin")
    evil_vae = Path(shutil.copytree(pipe, tmp_path / "evil-vae"))
    vae = Path(make_tiny_vae(str(evil_vae / "vae")))
    for f in vae.glob("diffusion_pytorch_model.*"):
        f.unlink()
    torch.save({"encoder.conv_in.weight": Payload(marker)}, vae / "diffusion_pytorch_model.bin")
    cases = [
        (["sample", "--checkpoint", str(evil), "--output", str(tmp_path / "s1"), "--num_samples", "1"], evil),
        (["export", "--checkpoint", str(evil), "--output", str(tmp_path / "e.pt")], evil),
        (["sample", "--checkpoint", str(evil_vae), "--output", str(tmp_path / "s2"), "--num_samples", "1",
          "--num_steps", "2"], evil_vae),
    ]  # fmt: skip
    for args, root in cases:
        code, _, err = call(args, capsys)
        line = _first_line(err)
        assert code == 1 and str(root) in line and "diffusion_pytorch_model.bin" in line, err
        assert "names code (torch.serialization" not in line and "that unpickling it would run: refused" in line, err
        assert "weights_only=False" not in err and "torch.load to learn more" not in err and "Traceback" not in err
        assert not marker.exists()
    assert not any((tmp_path / "s2").rglob("*.png"))


@pytest.mark.parametrize("kind", ["other tensors", "code"])
def test_an_inception_weights_file_is_checked_before_any_sampling(kind, trained, digits, marker, tmp_path, capsys):
    """A wrong --inception_weights file failed after all the samples were made (50,000 for FID-50K),
    with torch-fidelity's 17 kB list of missing keys or torch's paragraph on weights_only."""
    weights = tmp_path / "inception.pth"
    if kind == "code":
        torch.save({"fc.weight": Payload(marker)}, weights)
        expected = "that unpickling it would run: refused"
    else:
        torch.save({"fc.weight": torch.zeros(2, 2)}, weights)
        expected = "is not the InceptionV3 of FID"
    out = tmp_path / "eval"
    runs = {
        "evaluate": ["evaluate", "--checkpoint", str(trained), "--output", str(out), "--metrics", "is",
                     "--num_samples", "4", "--num_steps", "2", "--inception_weights", str(weights)],
        "test": ["test", "--config", DEMO, *TINY, "--data.path", str(digits), "--trainer.logger", "false",
                 "--ckpt_path", str(trained), "--evaluation.metrics", "[is]", "--evaluation.num_samples", "4",
                 "--evaluation.num_steps", "2", "--evaluation.inception_weights", str(weights)],
    }  # fmt: skip
    for name, args in runs.items():
        code, stdout, err = call(args, capsys)
        line = _first_line(err)
        assert code == 1 and f"the InceptionV3 weights file {weights} " in line and expected in line, (name, err)
        assert "wget https://" in line and "--inception_weights" in line and len(err) < 1500, (name, err)
        assert "weights_only=False" not in err and not marker.exists(), (name, err)
    assert not (out / "samples").exists()  # evaluate: refused before it sampled
