"""REG's class token in the latent store: written by ``extract`` in the same encoder pass as REPA's
patch features (the ``repa_class_token`` feature set), resumed, verified, refused for another encoder,
added to a store made before class tokens were stored, and read back into ``batch["repa_class_token"]``.

The encoder is a tiny class-path encoder with a class token first (``prefix_tokens = 1``, as DINOv2's
output), random weights saved to a file: every value below is a real encoder output.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dit_lightning.atomic import write_json
from dit_lightning.data import store as st
from dit_lightning.data.datamodule import LatentDataModule
from dit_lightning.data.extract import EXIT_AFTER_ENV, REPA_FIXES, extract_latents
from dit_lightning.data.rng import flip_bits
from dit_lightning.models.dit import DiT
from dit_lightning.models.encoders import load_encoder
from dit_lightning.models.repa import DigitsEncoder, REPAOptions
from dit_lightning.models.repa_head import REPAHead
from tests.data.test_repa_store import _flipped_pixel_store
from tests.helpers.data import make_digit_folder, tree_bytes

TOKEN = "tests.data.test_reg_store.TokenEncoder"
DIGITS = "dit_lightning.models.repa.DigitsEncoder"
QUIET = dict(num_workers=0, progress=False, device="cpu")
# float16 storage of O(1) values: half an ulp is ~5e-4 relative
F16 = dict(rtol=2e-3, atol=2e-4)


class TokenEncoder(DigitsEncoder):
    """DigitsEncoder (width 16) whose output starts with a class token: a linear map of the mean of
    its patch features plus the first patch's, so it depends on the whole image and differs for the
    mirrored image."""

    prefix_tokens = 1

    def __init__(self) -> None:
        super().__init__(width=16)
        self.token = nn.Linear(16, 16)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        z = super().forward(images)
        return torch.cat([self.token(F.gelu(z).mean(1, keepdim=True) + z[:, :1]), z], 1)


def _encode(weights: str, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The encoder's own (patch features, class token) of images in [0, 1], one pass."""
    patches, token = load_encoder(REPAOptions(encoder=TOKEN, weights=weights)).encode(images)
    assert token is not None
    return patches.numpy(), token.numpy()


def _strip_class_token(path: str) -> None:
    """Make ``path`` the store this code wrote before class tokens were stored: patch features only."""
    os.remove(os.path.join(path, "repa_class_token.json"))
    for k in range(st.load_plan(path).num_shards):
        os.remove(st.features_path(path, k, "repa_class_token"))
        record_path = os.path.join(path, "shards", f"{st.shard_stem(k)}.json")
        record = json.load(open(record_path))
        del record["repa_class_token"]
        write_json(record_path, record, indent=1)
    st.finalize_store(path)


def _extract(path: str, weights: str, **kw) -> dict:
    return extract_latents(output=path, repa_encoder=TOKEN, repa_weights=weights, **QUIET, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fast on a busy host, and the same float reductions in forked children
    root = tmp_path_factory.mktemp("reg")
    weights, other = str(root / "token.pt"), str(root / "other.pt")
    torch.manual_seed(0)
    torch.save(TokenEncoder().state_dict(), weights)
    torch.save(TokenEncoder().state_dict(), other)  # the next random draw: another encoder
    plain = _flipped_pixel_store(str(root / "plain"))  # 40 images with flips, 3 shards
    feat = str(root / "feat")
    shutil.copytree(plain, feat)
    summary = _extract(feat, weights, batch_size=7)
    old = str(root / "old")  # the same store as made before class tokens were stored
    shutil.copytree(feat, old)
    _strip_class_token(old)
    yield {"root": root, "weights": weights, "other": other, "plain": plain, "feat": feat, "old": old,
           "summary": summary}  # fmt: skip
    torch.set_num_threads(threads)


def test_one_pass_writes_the_patch_features_and_the_class_token(env):
    s = st.LatentStore(env["feat"])
    assert env["summary"]["finalized"] and env["summary"]["features_written"] == 3
    repa, token = s.features["repa"], s.features["repa_class_token"]
    assert (repa.tokens, repa.dim, token.tokens, token.dim) == (16, 16, 1, 16)
    assert token.source == repa.source and token.source["encoder"] == TOKEN and token.key != repa.key
    assert env["summary"]["repa_class_token"] == token.to_json()
    for k in range(3):  # each shard's one commit record commits both files
        record = s.shard_record(k)
        assert record["repa"]["key"] == repa.key and record["repa_class_token"]["key"] == token.key
    idx = np.arange(len(s))
    pixels = torch.from_numpy(s.read(idx).astype(np.float32)[:, :, 0])  # (N, F, 1, 8, 8) in [-1, 1]
    for f in (0, 1):
        patches, cls = _encode(env["weights"], (pixels[:, f] + 1) / 2)
        np.testing.assert_allclose(s.read_features("repa", idx, flip=f).astype(np.float32), patches, **F16)
        np.testing.assert_allclose(
            s.read_features("repa_class_token", idx, flip=f)[:, 0].astype(np.float32), cls, **F16
        )
    tokens = s.read_features("repa_class_token", idx)  # (N, F, 1, D)
    assert np.abs(tokens).mean() > 0.02 and not np.allclose(tokens[:, 0], tokens[:, 1], atol=0.01)
    assert not np.allclose(tokens[0], tokens[1], atol=0.01)  # distinct images, distinct tokens
    assert st.verify_store(env["feat"], fixes=REPA_FIXES) == [] and st.foreign_entries(env["feat"]) == []
    again = _extract(env["feat"], env["weights"])  # nothing left to do
    assert again["features_written"] == 0 and again["finalized"]


def test_an_encoder_without_class_token_writes_the_patch_features_only(env, tmp_path):
    out = str(tmp_path / "digits")
    shutil.copytree(env["plain"], out)
    torch.save(DigitsEncoder().state_dict(), str(tmp_path / "d.pt"))
    extract_latents(output=out, repa_encoder=DIGITS, repa_weights=str(tmp_path / "d.pt"), **QUIET)
    assert set(st.LatentStore(out).features) == {"repa"} and not os.path.exists(
        os.path.join(out, "repa_class_token.json")
    )


def _run_and_die(out: str, weights: str, exit_after: str) -> None:
    os.environ[EXIT_AFTER_ENV] = exit_after
    _extract(out, weights, batch_size=7)


@pytest.mark.parametrize("start, exit_after", [("plain", "1"), ("plain", "0+"), ("old", "0+")])
def test_killed_pass_resumes_to_the_bytes_of_one_pass(env, start, exit_after):
    """Kill the features pass after a committed shard ("1") or inside one ("0+": after its files,
    before its commit record), from a store without features or from one with patch features only;
    rerun, and get the bytes of the uninterrupted one-pass store."""
    import multiprocessing as mp

    out = str(env["root"] / f"kill_{start}_{exit_after.replace('+', 'p')}")
    shutil.copytree(env[start], out)
    proc = mp.get_context("fork").Process(target=_run_and_die, args=(out, env["weights"], exit_after))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 17  # os._exit from the test hook, no cleanup ran
    token = st.load_features_plan(out, "repa_class_token")
    assert token is not None
    assert st.features_status(out, token) == (([0], [1, 2]) if exit_after == "1" else ([], [0, 1, 2]))
    if exit_after == "0+":
        assert os.path.exists(st.features_path(out, 0, "repa_class_token"))  # written, not committed
    assert "repa_class_token" not in st.LatentStore(out).features  # meantime the store reads as before
    summary = _extract(out, env["weights"], batch_size=7)
    assert summary["finalized"] and summary["features_written"] == (2 if exit_after == "1" else 3)
    assert tree_bytes(out) == tree_bytes(env["feat"])


def test_a_store_with_patch_features_only_gets_the_class_token_added(env, tmp_path):
    """A store made before class tokens were stored serves plain REPA unchanged; the same extract
    command adds the class token (the patch features files stay as they are): the one-pass bytes."""
    out = str(tmp_path / "old")
    shutil.copytree(env["old"], out)
    before = tree_bytes(out)
    assert set(st.LatentStore(out).features) == {"repa"}
    dm = LatentDataModule(out, global_batch_size=8, num_workers=0)
    assert dm.repa_spec is not None and "class_token" not in dm.repa_spec
    assert set(next(iter(dm.train_dataloader()))) == {"x", "y", "index", "repa"}
    with pytest.raises(st.StoreError, match="another encoder than the one asked: weights sha256"):
        _extract(out, env["other"])  # refused before anything is written
    assert tree_bytes(out) == before
    summary = _extract(out, env["weights"], batch_size=7)
    assert summary["features_written"] == 3 and summary["finalized"]
    after = tree_bytes(out)
    assert all(after[n] == before[n] for n in before if n.endswith(".repa.npy"))
    assert after == tree_bytes(env["feat"])


def test_verify_names_a_corrupt_class_token_file(env, tmp_path):
    bad = str(tmp_path / "corrupt")
    shutil.copytree(env["feat"], bad)
    f = st.features_path(bad, 1, "repa_class_token")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:  # same size, other bytes: only the checksum can tell
        fh.seek(size - 32)
        fh.write(b"\x01" * 16)
    problems = st.verify_store(bad, fixes=REPA_FIXES)
    assert len(problems) == 1 and "shard-00001.repa_class_token.npy changed since it was written" in problems[0]
    assert f"delete {f} and rerun `dit-lightning extract --output {bad} --repa_encoder {TOKEN}" in problems[0]
    with open(f, "r+b") as fh:  # NaN (float16 0x7e00) where a value was: the values scan finds it
        fh.seek(size - 32)
        fh.write(b"\x00\x7e" * 4)
    assert "holds 4 non-finite values" in st.verify_store(bad, checksums=False, fixes=REPA_FIXES)[0]
    os.remove(f)  # the fix the message gives: delete it and rerun; only that shard is computed again
    summary = _extract(bad, env["weights"], batch_size=7)
    assert summary["features_written"] == 1 and tree_bytes(bad) == tree_bytes(env["feat"])


def test_class_token_of_another_encoder_is_refused(env, tmp_path):
    before = tree_bytes(env["feat"])
    with pytest.raises(st.StoreError, match=r"another encoder than the one asked.*repa_class_token\.json"):
        _extract(env["feat"], env["other"])
    assert tree_bytes(env["feat"]) == before
    # only the class token's record left (its patch features deleted): still that encoder's store
    out = str(tmp_path / "token_only")
    shutil.copytree(env["feat"], out)
    os.remove(os.path.join(out, "repa.json"))
    with pytest.raises(st.StoreError, match="another encoder than the one asked: weights sha256"):
        _extract(out, env["other"])


@pytest.mark.parametrize("workers", [0, 1])
def test_batch_class_token_is_the_encoders_of_the_flip_x_holds(env, workers):
    s = st.LatentStore(env["feat"])
    dm = LatentDataModule(env["feat"], global_batch_size=8, val_size=8, num_workers=workers, seed=3)
    spec = dm.repa_spec
    assert spec is not None and spec["class_token"] == s.features["repa_class_token"].to_json()
    dm.setup("fit")
    flipped_some = False
    for b in dm.train_dataloader():
        assert set(b) == {"x", "y", "index", "repa", "repa_class_token"}
        idx = b["index"].numpy()
        flip = flip_bits(3, 0, idx)
        flipped_some |= bool(flip.any() and not flip.all())
        token = b["repa_class_token"]
        assert token.shape == (8, 16) and token.dtype == torch.float32
        np.testing.assert_array_equal(b["x"].numpy(), s.read(idx, flip=flip)[:, 0].astype(np.float32))
        images = (b["x"] + 1) / 2  # the pixels of the flip x holds: the encoder's input
        patches, cls = _encode(env["weights"], images)
        np.testing.assert_allclose(token.numpy(), cls, **F16)
        np.testing.assert_allclose(b["repa"].numpy(), patches, **F16)
    assert flipped_some  # the batches mix both flips, so a wrong flip would show
    val = list(dm.val_dataloader())
    vi = np.concatenate([v["index"].numpy() for v in val])
    np.testing.assert_array_equal(
        np.concatenate([v["repa_class_token"].numpy() for v in val]),
        s.read_features("repa_class_token", vi, flip=0)[:, 0].astype(np.float32),
    )
    off = LatentDataModule(env["feat"], global_batch_size=8, num_workers=workers, repa_features=False)
    assert off.repa_spec is None and set(next(iter(off.train_dataloader()))) == {"x", "y", "index"}


def _head(weights: str, class_token_weight: float) -> REPAHead:
    options = REPAOptions(encoder=TOKEN, weights=weights, depth=1, class_token_weight=class_token_weight)
    head = REPAHead(options, (1, 8, 8))
    net = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=1, num_heads=2, num_classes=2)
    head.attach(net)
    return head


def test_reg_refuses_a_store_without_the_class_token(env):
    old = LatentDataModule(env["old"], global_batch_size=8, num_workers=0).repa_spec
    new = LatentDataModule(env["feat"], global_batch_size=8, num_workers=0).repa_spec
    assert old is not None and new is not None
    reg, repa = _head(env["weights"], 0.03), _head(env["weights"], 0.0)
    repa.check_store(old)  # plain REPA: the patch features are enough
    repa.check_store(new)
    reg.check_store(new)
    with pytest.raises(ValueError) as refused:
        reg.check_store(old)
    message = str(refused.value)
    assert "\n" not in message and "REG (model.repa.class_token_weight 0.03)" in message
    assert f"dit-lightning extract --output STORE --repa_encoder {TOKEN} --repa_weights <token.pt>" in message
    assert "data.repa_features false" in message
    other = {**new, "class_token": {**new["class_token"], "weights_sha256": "0" * 64, "dim": 8}}
    with pytest.raises(ValueError, match=r"class token: weights sha256 .*class token width 8 \(the encoder gives 16\)"):
        reg.check_store(other)
    repa.check_store(other)  # without REG the class token is not read
    # a REG run's validate / test read the store's class token too: checked before the first batch
    from types import SimpleNamespace

    from dit_lightning.module import DiTModule

    options = REPAOptions(encoder=TOKEN, weights=env["weights"], depth=1, projector_dim=8, class_token_weight=0.03)
    module = DiTModule(model="custom", latent_shape=(1, 8, 8), num_classes=2, depth=1, hidden_size=32, num_heads=2,
                       patch_size=2, objective="flow", vae="none", repa=options)  # fmt: skip
    module._trainer = SimpleNamespace(datamodule=LatentDataModule(env["old"], global_batch_size=8, num_workers=0))
    for hook in (module.on_validation_start, module.on_test_start):
        with pytest.raises(ValueError, match=r"REG \(model.repa.class_token_weight 0.03\)"):
            hook()


def test_inline_extraction_writes_both_sets_in_each_shard_commit(tmp_path):
    """Extracting an image folder (a pixel store, --vae none) with the encoder: every shard's commit
    holds the class token beside the patch features; a kill inside a shard resumes to the same bytes."""
    import multiprocessing as mp

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        images = str(tmp_path / "images")
        make_digit_folder(images, n=20, size=(8, 8))
        weights = str(tmp_path / "token.pt")
        torch.manual_seed(2)
        torch.save(TokenEncoder().state_dict(), weights)
        args = dict(vae="none", image_size=8, shard_size=8, batch_size=5, repa_encoder=TOKEN, repa_weights=weights)
        ref = extract_latents(images, str(tmp_path / "ref"), **args, **QUIET)
        s = st.LatentStore(ref["output"])
        assert ref["shards_written"] == 3 and set(s.features) == {"repa", "repa_class_token"}
        idx = np.arange(len(s))
        pixels = torch.from_numpy(s.read(idx).astype(np.float32)[:, :, 0])
        for f in (0, 1):
            np.testing.assert_allclose(
                s.read_features("repa_class_token", idx, flip=f)[:, 0].astype(np.float32),
                _encode(weights, (pixels[:, f] + 1) / 2)[1],
                **F16,
            )
        out = str(tmp_path / "killed")

        def die() -> None:
            os.environ[EXIT_AFTER_ENV] = "1+"
            extract_latents(images, out, **args, **QUIET)  # type: ignore[arg-type]

        proc = mp.get_context("fork").Process(target=die)
        proc.start()
        proc.join(120)
        assert proc.exitcode == 17 and st.shard_status(out)[0] == [0]
        again = extract_latents(images, out, **args, **QUIET)
        assert again["shards_written"] == 2 and tree_bytes(out) == tree_bytes(ref["output"])
    finally:
        torch.set_num_threads(threads)
