"""Extraction with a tiny random AutoencoderKL loaded from disk (the real loading code)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from dit_lightning.data import store as st
from dit_lightning.data.extract import EXIT_AFTER_ENV, extract_latents
from dit_lightning.data.preprocessing import adm_center_crop, preprocess
from tests.helpers.data import make_image_folder, make_tiny_vae, tree_bytes

ARGS = dict(image_size=32, batch_size=2, shard_size=4, num_workers=0, progress=False)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # One intra-op thread for the whole module: float reductions then split the same way in
    # the forked children (and fork never meets a live OpenMP pool), so bytes are comparable.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("extract")
    images, vae = str(root / "images"), str(root / "vae")
    kinds = make_image_folder(images)
    make_tiny_vae(vae)
    ref = str(root / "ref")
    summary = extract_latents(images, ref, vae=vae, **ARGS)
    yield {"root": root, "images": images, "vae": vae, "kinds": kinds, "ref": ref, "summary": summary}
    torch.set_num_threads(threads)


def test_store_contents_and_report(env):
    s = st.LatentStore(env["ref"])
    kinds = env["kinds"]
    n_ok = sum(k != "skipped" for k in kinds.values())
    assert len(s) == n_ok == env["summary"]["images_done"] == env["summary"]["count"]
    assert env["summary"]["images_skipped"] == 3 and env["summary"]["images_converted"] == 5
    assert env["summary"]["finalized"] and env["summary"]["shards_total"] == 5
    assert s.latent_shape == (4, 16, 16) and s.meta["sample_shape"] == [2, 2, 4, 16, 16]
    assert s.class_names == ["cls_a", "cls_b", "cls_c"] and s.scale_factor == pytest.approx(0.18215)
    assert s.meta["vae"] == env["vae"] and s.meta["image_size"] == 32 and s.meta["variant"] == "moments"
    sources = open(os.path.join(env["ref"], "sources.txt")).read().split()
    assert sources == sorted(p for p, k in kinds.items() if k != "skipped")
    assert list(s.labels) == [["cls_a", "cls_b", "cls_c"].index(p.split("/")[0]) for p in sources]
    report = [json.loads(line) for line in open(os.path.join(env["ref"], "report.jsonl"))]
    got = {r["path"]: r["status"] for r in report}
    assert got == {p: k for p, k in kinds.items() if k != "ok"}
    reasons = {r["path"]: r["reason"] for r in report}
    assert "0 bytes" in reasons["cls_a/zero.JPEG"] and "truncated" in reasons["cls_a/truncated.JPEG"]
    assert "CMYK" in reasons["cls_b/cmyk.JPEG"] and "upscaled from 12x9" in reasons["cls_b/tiny.png"]
    assert "alpha" in reasons["cls_c/alpha.png"] and "alpha" in reasons["cls_c/palette.png"]


def test_moments_equal_encoding_of_image_and_its_flip(env):
    from diffusers import AutoencoderKL

    s = st.LatentStore(env["ref"])
    vae = AutoencoderKL.from_pretrained(env["vae"], low_cpu_mem_usage=False).eval()
    sources = open(os.path.join(env["ref"], "sources.txt")).read().split()
    for i in [0, sources.index("cls_b/cmyk.JPEG"), len(s) - 1]:
        x, _ = preprocess(os.path.join(env["images"], sources[i]), 32)
        with torch.no_grad():
            for f, img in enumerate([x, x.flip(-1)]):
                d = vae.encode(img[None]).latent_dist
                stored = s.read([i], flip=f)[0].astype(np.float32)  # (K, C, H, W)
                np.testing.assert_allclose(stored[0], d.mean[0].numpy(), rtol=3e-3, atol=3e-3)
                np.testing.assert_allclose(stored[1], d.logvar[0].numpy(), rtol=3e-3, atol=3e-3)
        assert not np.allclose(s.read([i], flip=0), s.read([i], flip=1))


def test_adm_crop_sizes():
    from PIL import Image

    for size in [(600, 300), (31, 70), (5, 3), (64, 64)]:
        out = adm_center_crop(Image.new("RGB", size, (10, 20, 30)), 32)
        assert out.size == (32, 32) and out.getpixel((16, 16)) == (10, 20, 30)


def _run_and_die(images: str, out: str, vae: str, exit_after: str) -> None:
    os.environ[EXIT_AFTER_ENV] = exit_after
    extract_latents(images, out, vae=vae, **ARGS)  # type: ignore[arg-type]


@pytest.mark.parametrize("exit_after", ["1", "2+"])
def test_killed_run_resumes_to_identical_store(env, exit_after):
    """Kill an extraction process after a committed shard ("1") or inside a shard ("2+":
    after its data file, before its commit record), rerun, and get the bytes of an
    uninterrupted run. The child is forked (diffusers is already imported here)."""
    import multiprocessing as mp

    out = str(env["root"] / f"resume{exit_after.replace('+', 'p')}")
    proc = mp.get_context("fork").Process(target=_run_and_die, args=(env["images"], out, env["vae"], exit_after))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 17  # os._exit from the test hook, no cleanup ran
    assert not os.path.exists(os.path.join(out, "meta.json"))
    done, missing = st.shard_status(out)
    assert done == ([0] if exit_after == "1" else [0, 1])
    if exit_after == "2+":
        assert os.path.exists(os.path.join(out, "shards", "shard-00002.npy"))
    with pytest.raises(st.IncompleteStoreError, match="resume"):
        st.LatentStore(out)
    summary = extract_latents(env["images"], out, vae=env["vae"], **ARGS)
    assert summary["finalized"] and summary["shards_already_done"] == len(done)
    assert tree_bytes(out) == tree_bytes(env["ref"])


def test_signature_parses_with_jsonargparse(env):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_function_arguments(extract_latents)
    cfg = parser.parse_args(
        ["--image_root", "a", "--output", "b", "--storage_dtype", "bfloat16", "--flips", "false", "--rank", "1"]
    )
    assert cfg.storage_dtype == "bfloat16" and cfg.flips is False and cfg.rank == 1 and cfg.world_size is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--image_root", "a", "--output", "b", "--variant", "nope"])


def test_data_parallel_ranks_and_late_finalize(env):
    out = str(env["root"] / "dp")
    s1 = extract_latents(env["images"], out, vae=env["vae"], rank=1, world_size=2, **ARGS)
    assert not s1["finalized"] and s1["shards_written"] == 2  # shards 1 and 3
    assert st.shard_status(out)[0] == [1, 3]
    s0 = extract_latents(env["images"], out, vae=env["vae"], rank=0, world_size=2, **ARGS)
    assert s0["finalized"] and s0["shards_written"] == 3
    assert tree_bytes(out) == tree_bytes(env["ref"])
    again = extract_latents(env["images"], out, vae=env["vae"], **ARGS)  # nothing left to do
    assert again["shards_written"] == 0 and again["finalized"]


def test_a_relative_vae_is_recorded_absolute_and_a_log_file_gets_progress_lines(env, monkeypatch, capsys):
    """`--vae tiny-vae` was recorded as typed (`sample` elsewhere read it as a hub id); in a log file
    (not a terminal) extract printed nothing until it ended."""
    monkeypatch.chdir(env["root"])
    out = str(env["root"] / "relative")
    extract_latents(env["images"], out, vae="vae", **{**ARGS, "progress": True})
    assert st.LatentStore(out).meta["vae"] == env["vae"]  # absolute
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("extract rank 0/1: ")]
    assert lines[0].startswith("extract rank 0/1: 2/17 images (11.8%), ") and "img/s, ETA " in lines[0]
    assert lines[-1].startswith("extract rank 0/1: 17/17 images (100.0%), ")
    # a store recorded with the absolute path resumes from a relative one (and the reverse: stores made before)
    assert extract_latents(env["images"], env["ref"], vae="vae", **ARGS)["shards_written"] == 0


def test_settings_mismatch_on_resume_is_refused(env):
    with pytest.raises(st.StoreError, match="image_size: store has 32, asked 64"):
        extract_latents(env["images"], env["ref"], vae=env["vae"], **{**ARGS, "image_size": 64})


def test_sample_variant_bfloat16_without_flips(env):
    kw = {**ARGS, "storage_dtype": "bfloat16", "variant": "sample", "flips": False, "limit": 6}
    a = extract_latents(env["images"], str(env["root"] / "sa"), vae=env["vae"], seed=1, **kw)
    b = extract_latents(env["images"], str(env["root"] / "sb"), vae=env["vae"], seed=1, **kw)
    c = extract_latents(env["images"], str(env["root"] / "sc"), vae=env["vae"], seed=2, **kw)
    sa, sb, sc = (st.LatentStore(x["output"]) for x in (a, b, c))
    assert len(sa) == 3 and sa.meta["sample_shape"] == [1, 1, 4, 16, 16] and sa.dtype == "bfloat16"
    raw = sa.read(np.arange(3))
    assert raw.dtype == np.uint16
    np.testing.assert_array_equal(raw, sb.read(np.arange(3)))  # noise is a function of (seed, file)
    assert not np.array_equal(raw, sc.read(np.arange(3)))
