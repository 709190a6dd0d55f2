"""Bad inputs end with one clear message (the problem and the fix) before any work, and nothing is
deleted or overwritten: config values, stores, images and the outputs of the tools. Each case is
the real ``dit-lightning`` command (in this process where it fails before training, else in a
subprocess)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dit_lightning.data import store as st
from tests.helpers.cli import DEMO, TINY, run_cli
from tests.helpers.data import make_image_folder, make_random_store, make_tiny_vae
from tests.reliability.conftest import call, fit, one_message

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- config values -----------------------------------------------------------------------------


def test_a_negative_learning_rate_is_named_not_misparsed(digits, capsys):
    """`--model.optimizer.lr -1e-3` read "expected one argument" (argparse took the value for an option)."""
    code, _, err = call(
        ["fit", "--config", DEMO, *TINY, "--data.path", str(digits), "--model.optimizer.lr", "-1e-3"], capsys
    )
    assert code == 1 and "--model.optimizer.lr -0.001" in err and ">= 0" in err and "expected one" not in err
    one_message(err)


@pytest.mark.parametrize(
    "option, message",
    [
        (["--model.model", "DiT-XXL/2"], "unknown DiT model 'DiT-XXL/2': choose one of DiT-S/2, DiT-S/4"),
        (
            ["--model.patch_size", "3"],
            "patch_size 3 does not divide the latent size 8: choose a patch size among [1, 2",
        ),
        (
            ["--model.num_heads", "5"],
            "hidden_size 32 is not divisible by num_heads 5: choose a num_heads that divides 32",
        ),
        (
            ["--model.activation_checkpointing", "bogus"],
            "activation_checkpointing='bogus' is not understood: use 'none'",
        ),
    ],
    ids=["model-name", "patch-size", "heads", "activation-checkpointing"],
)
def test_an_error_raised_while_the_model_is_built_is_the_message(digits, capsys, option, message):
    """It came wrapped in jsonargparse's union noise: the subtypes, their errors, the whole config."""
    code, _, err = call(["fit", "--config", DEMO, *TINY, "--data.path", str(digits), *option], capsys)
    assert code == 1 and f"dit-lightning fit: error: {message}" in err, err
    one_message(err)


def test_a_bad_init_from_is_the_message(trained, digits, tmp_path, capsys):
    """Another architecture, or a file that is not a DiT (a malicious one: test_bad_checkpoints.py)."""
    exported, foreign = tmp_path / "dit.pt", tmp_path / "not-a-dit.pt"
    call(["export", "--checkpoint", str(trained), "--output", str(exported)], capsys)
    torch.save({"encoder.weight": torch.zeros(3)}, foreign)
    fit = ["fit", "--config", DEMO, *TINY, "--data.path", str(digits), "--model.init_from"]
    code, _, err = call([*fit, str(exported), "--model.hidden_size", "64"], capsys)
    assert code == 1 and f"error: checkpoint '{exported}' holds another architecture" in err
    one_message(err)
    code, _, err = call([*fit, str(foreign)], capsys)
    assert code == 1 and f"error: checkpoint '{foreign}' is not a DiT checkpoint" in err
    one_message(err)


def test_a_typo_in_data_path_does_not_build_the_digits_store_there(tmp_path, capsys):
    """configs/demo.yaml's `data.prepare: digits` built the 8x8 digits at a mistyped --data.path (meant
    for the user's own store) and trained on them, exit 0."""
    typo = tmp_path / "mnsit"
    code, _, err = call(["fit", "--config", DEMO, *TINY, "--data.path", str(typo)], capsys)
    assert code == 1 and f"--data.path {typo} does not exist" in err and "add --data.prepare digits" in err, err
    one_message(err)
    assert list(tmp_path.iterdir()) == []  # no store, and no run directory (the working directory is tmp_path)


def test_a_command_refused_before_its_first_batch_leaves_no_run_directory(trained, digits, tmp_path, capsys):
    """`validate` refused in its set-up (here a held-out split larger than the store) left the demo's
    outputs/demo/version_N behind (an empty log, its config record): the next fit became version_N+1."""
    args = ["validate", "--config", DEMO, *TINY, "--data.path", str(digits), "--ckpt_path", str(trained)]
    code, _, err = call([*args, "--data.val_size", "5000"], capsys)
    assert code == 1 and "val_size 5000" in err, err
    assert list(tmp_path.iterdir()) == []  # the demo's logger writes to outputs/demo, in the working directory


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # Lightning: the fit's callbacks
def test_the_digits_metrics_refuse_a_store_that_is_not_the_digits(trained, tmp_path, capsys):
    """`test` scored a model of other 1-channel, 10-class images (MNIST) with the 8x8 digits' classifier
    and reference ("accuracy 0.10, FD 103"; real MNIST scores 0.14) without a word."""
    other = tmp_path / "mnist"
    make_random_store(str(other), 200, (1, 8, 8), 10, variant="sample", flips=False, vae="none/pixels")
    output = tmp_path / "metrics.json"
    code, out, err = call(
        ["test", "--config", DEMO, *TINY, "--data.path", str(other), "--ckpt_path", str(trained),
         "--trainer.logger", "false", "--evaluation.num_samples", "10", "--evaluation.num_steps", "2",
         "--evaluation.output", str(output)],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    note = "dit-lightning test: note: the digits metrics score only the bundled 8x8 digits (data.prepare: digits); "
    assert f"{note}the store holds random(seed=0) (1x8x8, 10 classes): not measured" in err, err
    assert "--evaluation.metrics [fid] with --evaluation.reference DIR" in err
    assert "test/loss" in out and "digits_accuracy" not in out + err and not output.exists()


def test_a_misspelled_model_option_names_the_option_and_where_the_options_are_listed(capsys):
    """`fit --help` does not list the model's options (the model is a class chosen by class_path)."""
    code, _, err = call(["fit", "--config", DEMO, "--model.hiden_size", "64"], capsys)
    hint = "--model.hiden_size: DiTModule has no option 'hiden_size'; did you mean --model.hidden_size?"
    assert code == 2 and hint in err and "Union" not in err, err
    listed = "dit-lightning fit --model.help dit_lightning.module.DiTModule"
    assert f"({listed} lists the options of DiTModule)" in err
    code, out, _ = call(listed.split()[1:], capsys)  # the pointer works
    assert code == 0 and "--model.hidden_size HIDDEN_SIZE" in out and "--model.activation_checkpointing" in out


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(), reason="needs a machine without GPU"
)
def test_a_gpu_accelerator_without_a_gpu_offers_cpu_or_auto(digits, capsys):
    """Lightning said "No supported gpu backend found!"."""
    code, _, err = call(
        ["fit", "--config", DEMO, *TINY, "--data.path", str(digits), "--trainer.accelerator", "gpu"], capsys
    )
    assert code == 1 and "error: --trainer.accelerator gpu: this machine has no GPU PyTorch can use" in err, err
    assert "use --trainer.accelerator cpu, or auto" in err
    one_message(err)


def test_a_zero_learning_rate_warns(digits, tmp_path):
    proc = run_cli(fit(tmp_path, "lr0", 1, digits, ["--model.optimizer.lr", "0"]), tmp_path)
    assert "learning rate of AdamW is 0" in proc.stderr and "never changes the weights" in proc.stderr


def test_sample_refuses_num_steps_0_instead_of_using_the_default(trained, tmp_path, capsys):
    out = tmp_path / "samples"
    code, _, err = call(["sample", "--checkpoint", str(trained), "--output", str(out), "--num_steps", "0"], capsys)
    assert code == 1 and "--num_steps 0: must be at least 2" in err and not out.exists()
    one_message(err)


def test_prune_refuses_a_depth_that_prunes_nothing(trained, tmp_path, capsys):
    out = tmp_path / "pruned.pt"
    code, _, err = call(["prune", "--checkpoint", str(trained), "--output", str(out), "--depth", "5"], capsys)
    assert code == 1 and "--depth 5" in err and "has depth 2" in err and "from 1 to 1" in err and not out.exists()
    code, _, err = call(["prune", "--checkpoint", str(trained), "--output", str(out), "--heads", "4"], capsys)
    assert code == 1 and "--heads 4" in err and "4 heads" in err and not out.exists()
    code, _, err = call(["prune", "--checkpoint", str(trained), "--output", str(out)], capsys)
    assert code == 1 and "nothing to prune" in err
    code, _, _ = call(["prune", "--checkpoint", str(trained), "--output", str(out), "--depth", "1"], capsys)
    assert code == 0 and out.exists()


def test_export_does_not_overwrite_an_existing_file(trained, tmp_path, capsys):
    out = tmp_path / "dit.pt"
    out.write_bytes(b"precious")
    code, _, err = call(["export", "--checkpoint", str(trained), "--output", str(out)], capsys)
    assert code == 1 and "already exists" in err and "--overwrite true" in err and out.read_bytes() == b"precious"
    code, _, _ = call(["export", "--checkpoint", str(trained), "--output", str(out), "--overwrite", "true"], capsys)
    assert code == 0 and set(torch.load(out, weights_only=True)) == {"model", "ema", "opt", "args"}


def test_export_raw_then_sample_keeps_the_architecture(trained, tmp_path, capsys):
    """A raw export (a bare state dict) of a 4-head model with hidden size 32 was sampled as 2 heads
    (hidden / 64 would even be 0): the architecture now travels in ``<file>.json`` beside it."""
    raw = tmp_path / "dit-raw.pt"
    code, _, _ = call(["export", "--checkpoint", str(trained), "--output", str(raw), "--format", "raw"], capsys)
    assert code == 0 and json.loads(Path(f"{raw}.json").read_text())["args"]["model_config"]["num_heads"] == 4
    args = ["--num_samples", "2", "--num_steps", "2", "--labels", "3", "--device", "cpu", "--progress", "false"]
    code, _, err = call(["sample", "--checkpoint", str(raw), "--output", str(tmp_path / "from-raw"), *args], capsys)
    assert code == 0 and "assuming" not in err, err
    config = json.loads((tmp_path / "from-raw" / "sample_config.json").read_text())
    assert config["num_heads"] == 4 and config["model"]["num_heads"] == 4
    # the same images as sampling the training checkpoint itself
    code, _, _ = call(["sample", "--checkpoint", str(trained), "--output", str(tmp_path / "from-ckpt"), *args], capsys)
    for name in ("000000-c3.png", "000001-c3.png"):
        assert (tmp_path / "from-raw" / "samples" / name).read_bytes() == (
            tmp_path / "from-ckpt" / "samples" / name
        ).read_bytes()
    # without its record, the file says what it had to guess
    os.unlink(f"{raw}.json")
    code, _, err = call(["sample", "--checkpoint", str(raw), "--output", str(tmp_path / "bare"), *args], capsys)
    assert code == 0 and "is not recorded" in err and "assuming" in err


# ---- overwrite deletes only what is provably a store -------------------------------------------


def test_extract_overwrite_never_deletes_the_images_or_a_foreign_directory(tmp_path, capsys):
    project = tmp_path / "proj"
    images = project / "images"
    make_image_folder(str(images), with_bad=False)
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    vae = make_tiny_vae(str(tmp_path / "vae"))
    base = ["extract", "--vae", vae, "--image_size", "32", "--num_workers", "0", "--overwrite", "true"]
    # the output contains the images: refused, before anything is listed or loaded
    code, _, err = call([*base, "--image_root", str(images), "--output", str(project)], capsys)
    assert code == 1 and "contains the images" in err
    # a directory that is not a store: refused, nothing deleted
    (project / "notes.txt").write_text("mine")
    code, _, err = call([*base, "--image_root", str(images), "--output", str(project / "..")], capsys)
    assert code == 1 and "contains the images" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    code, _, err = call([*base, "--image_root", str(images), "--output", str(other)], capsys)
    assert code == 1 and "not a latent store" in err and (other / "keep.txt").read_text() == "mine"
    one_message(err)
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == sorted([*before, Path("notes.txt")])
    # a store with a foreign file in it: refused too
    out = tmp_path / "latents"
    code, _, _ = call([*base, "--image_root", str(images), "--output", str(out)], capsys)
    assert code == 0 and st.is_store(out)
    (out / "my-notes.txt").write_text("mine")
    code, _, err = call([*base, "--image_root", str(images), "--output", str(out)], capsys)
    assert code == 1 and "my-notes.txt" in err and (out / "my-notes.txt").exists()
    # a bad VAE is found before the old store is deleted
    os.unlink(out / "my-notes.txt")
    code, _, err = call(
        [*base[:1], "--vae", str(tmp_path / "no-vae"), *base[3:], "--image_root", str(images), "--output", str(out)],
        capsys,
    )
    assert code == 1 and "cannot load the VAE" in err and st.is_store(out)
    # a real store is replaced
    code, _, _ = call([*base, "--image_root", str(images), "--output", str(out)], capsys)
    assert code == 0 and st.is_store(out)


def test_prepare_digits_overwrite_replaces_only_a_store(digits, tmp_path, capsys):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('my work')")
    code, _, err = call(["prepare-digits", "--output", str(project), "--overwrite", "true"], capsys)
    assert code == 1 and "not a latent store" in err and (project / "train.py").exists()
    code, _, _ = call(["prepare-digits", "--output", str(tmp_path / "d"), "--size", "16"], capsys)
    code, _, _ = call(["prepare-digits", "--output", str(tmp_path / "d"), "--overwrite", "true"], capsys)
    assert code == 0 and st.LatentStore(tmp_path / "d").latent_shape == (1, 8, 8)


def test_finalize_only_needs_no_image_root(tmp_path, capsys):
    path = tmp_path / "store"
    make_random_store(str(path), n=20, latent_shape=(4, 4, 4), num_classes=3, shard_size=8)
    os.unlink(path / st.META_FILE)
    code, _, err = call(["fit", "--config", DEMO, *TINY, "--data.path", str(path), "--data.prepare", "null"], capsys)
    suggestion = f"dit-lightning extract --output {path} --finalize_only true"
    assert code == 1 and suggestion in err
    code, _, _ = call(suggestion.split()[1:], capsys)
    assert code == 0 and len(st.LatentStore(path)) == 20


# ---- stores ------------------------------------------------------------------------------------


def test_a_truncated_meta_json_is_named_with_the_fix(digits_copy, capsys):
    meta = digits_copy / st.META_FILE
    meta.write_text(meta.read_text()[:200])
    code, _, err = call(["fit", "--config", DEMO, *TINY, "--data.path", str(digits_copy)], capsys)
    assert code == 1 and f"{meta} is truncated or corrupt" in err and "--finalize_only true" in err
    assert "JSONDecodeError" not in err
    one_message(err)


def test_a_resized_or_corrupted_shard(digits_copy, capsys):
    shard = digits_copy / "shards" / "shard-00000.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    code, _, err = call(["verify", "--path", str(digits_copy)], capsys)
    assert code == 1 and "truncated or padded" in err and "rerun the extraction" in err
    # corrupted in place: the same size, so only the checksum finds it
    shard.write_bytes(data[:1000] + bytes(b ^ 0xFF for b in data[1000:1100]) + data[1100:])
    assert st.is_store(digits_copy)
    code, _, err = call(["verify", "--path", str(digits_copy)], capsys)
    assert code == 1 and "changed since it was written (sha256" in err
    with pytest.raises(st.StoreError, match="changed since it was written"):
        from dit_lightning.data import LatentDataModule

        LatentDataModule(str(digits_copy), global_batch_size=32, num_workers=0, verify_checksums=True).setup("fit")
    shard.write_bytes(data)
    code, out, _ = call(["verify", "--path", str(digits_copy)], capsys)
    assert code == 0 and "checksums, values ok" in out


def test_a_store_of_other_latents_than_the_checkpoint_blames_data_path(trained, tmp_path, capsys):
    """Resuming (or initialising) on a store of another shape blamed the model config."""
    from dit_lightning.data import prepare_digits

    big = prepare_digits(str(tmp_path / "digits16"), size=16)
    proc = run_cli(
        ["validate", "--config", DEMO, *TINY, "--data.path", big, "--trainer.logger", "false", "--ckpt_path",
         str(trained)],
        tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and "--data.path" in proc.stderr and "(1, 8, 8)" in proc.stderr, proc.stderr[-2000:]
    assert "(1, 16, 16)" in proc.stderr and "Configure the model" not in proc.stderr
    exported = tmp_path / "dit.pt"
    call(["export", "--checkpoint", str(trained), "--output", str(exported)], capsys)
    code, _, err = call(
        ["fit", "--config", DEMO, *TINY, "--data.path", big, "--model.init_from", str(exported)], capsys
    )
    assert code == 1 and f"error: --model.init_from {exported} was trained on latents (1, 8, 8)" in err
    assert "--data.path" in err and "(1, 16, 16)" in err
    one_message(err)


# ---- images ------------------------------------------------------------------------------------


def test_extract_of_images_that_are_all_bad_says_so(tmp_path, capsys):
    images = tmp_path / "images"
    for cls in ("a", "b"):
        (images / cls).mkdir(parents=True)
        (images / cls / "x.JPEG").write_bytes(b"not a jpeg at all")
        (images / cls / "empty.png").write_bytes(b"")
    vae = make_tiny_vae(str(tmp_path / "vae"))
    base = ["extract", "--vae", vae, "--image_size", "32", "--num_workers", "0", "--progress", "false"]
    code, _, err = call([*base, "--image_root", str(images), "--output", str(tmp_path / "out")], capsys)
    assert code == 1 and "none of the 4 files" in err and "report.jsonl" in err
    (images / "c").mkdir()
    (images / "c" / "notes.txt").write_text("no image")
    for path in images.rglob("*.*"):
        if path.suffix != ".txt":
            path.unlink()
    code, _, err = call([*base, "--image_root", str(images), "--output", str(tmp_path / "out2")], capsys)
    assert code == 1 and "no images under" in err


def test_verify_finds_nan_in_a_store(tmp_path, capsys):
    path = tmp_path / "store"
    make_random_store(str(path), n=20, latent_shape=(4, 4, 4), num_classes=3, shard_size=8)
    shard = np.load(path / "shards" / "shard-00001.npy", mmap_mode="r+")
    shard[3, 0, 0, 0, 0, 0] = np.nan
    shard.flush()
    del shard
    code, _, err = call(["verify", "--path", str(path), "--checksums", "false"], capsys)
    assert code == 1 and "shard-00001.npy holds 1 non-finite values" in err and "its sample 3" in err


def test_labels_out_of_range_give_the_repair_command(digits_copy, capsys):
    """ "labels outside [0, 10); the store is corrupt" named no way out."""
    labels = np.load(digits_copy / st.LABELS_FILE)
    labels[7] = 12
    np.save(digits_copy / st.LABELS_FILE, labels)
    code, _, err = call(["fit", "--config", DEMO, *TINY, "--data.path", str(digits_copy)], capsys)
    repair = f"dit-lightning extract --output {digits_copy} --finalize_only true"
    first = err.splitlines()[0]
    assert code == 1 and "labels outside the store's 10 classes (sample 7: label 12)" in first and repair in first, err
    one_message(err)
    code, _, err = call(repair.split()[1:], capsys)  # the repair: labels.npy again from the shards
    assert code == 0, err
    code, out, _ = call(["verify", "--path", str(digits_copy)], capsys)
    assert code == 0 and "ok" in out
    # a shard's own labels corrupt: the repair says so, with its own fix
    shard_labels = digits_copy / "shards" / "shard-00001.labels.npy"
    np.save(shard_labels, np.full_like(np.load(shard_labels), 99))
    code, _, err = call(repair.split()[1:], capsys)
    assert code == 1 and "shard 1 of" in err and "shard-00001.labels.npy" in err and "rerun the same" in err, err


def test_cli_users_are_told_the_flag_not_the_python_argument(digits, tmp_path, capsys):
    """ "pass overwrite=True" is Python; on the command line it is `--overwrite true`."""
    code, _, err = call(["prepare-digits", "--output", str(digits), "--size", "16"], capsys)
    assert code == 1 and "--overwrite true" in err and "overwrite=True" not in err, err
    spec = st.StoreSpec(
        latent_shape=(4, 4, 4), dtype="float16", variant="moments", flips=False, scale_factor=0.18215, vae="v",
        image_size=32, class_names=("a",), source="images", num_items=1, shard_size=1,
    )  # fmt: skip
    st.write_plan(tmp_path / "store", spec)  # what `extract` runs: a second extract with other settings
    with pytest.raises(st.StoreError, match="--overwrite true") as e:
        st.write_plan(tmp_path / "store", dataclasses.replace(spec, shard_size=2))
    assert "overwrite=True" not in str(e.value)


def test_sample_and_extract_refuse_an_unwritable_output_like_export(trained, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    images = tmp_path / "images"
    (images / "a").mkdir(parents=True)
    runs = {
        "export": ["export", "--checkpoint", str(trained), "--output", str(blocker / "x" / "dit.pt")],
        "sample": ["sample", "--checkpoint", str(trained), "--output", str(blocker / "x"), "--num_samples", "1"],
        "extract": ["extract", "--image_root", str(images), "--output", str(blocker / "x"), "--vae", "none"],
    }
    for name, args in runs.items():
        code, _, err = call(args, capsys)
        line = err.splitlines()[0]
        assert code == 1 and "cannot write the output directory" in line and f"{blocker} is a file" in line, err
        assert line.endswith("Choose another --output."), (name, err)
    assert blocker.read_text() == "a file where a directory should be"


def test_a_full_disk_during_extract_reads_as_one(tmp_path, capsys):
    from tests.helpers.full_disk import full_disk

    images, disk = tmp_path / "images", tmp_path / "disk"
    make_image_folder(str(images), with_bad=False)
    disk.mkdir()
    base = ["extract", "--image_root", str(images), "--vae", make_tiny_vae(str(tmp_path / "vae")),
            "--image_size", "32", "--num_workers", "0", "--shard_size", "2", "--progress", "false"]  # fmt: skip
    with full_disk(str(disk), 3, 10):  # room for the plan and shard 0's data and labels
        code, _, err = call([*base, "--output", str(disk / "a")], capsys)
        assert code == 1 and f"no space left on {disk / 'a' / 'shards'} while writing shard-00000.json" in err, err
        one_message(err)
        # the disk stays full: a new store cannot even get its directory
        code, _, err = call([*base, "--output", str(disk / "b")], capsys)
        assert code == 1 and f"no space left on {disk} while creating the directory b" in err, err
        assert "[Errno 28]" not in err.splitlines()[0]
    assert not [p for p in (disk / "a").rglob("*") if p.name.endswith(".tmp")]  # nothing partial
    assert not (disk / "a" / "shards" / "shard-00000.json").exists()
