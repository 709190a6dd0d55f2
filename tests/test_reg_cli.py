"""REG from the command line: a REG run with the alignment cut off inside it, stopped by SIGTERM and
resumed, then ``test`` (digits metrics), ``predict``, ``sample``, ``evaluate`` and an export of its
checkpoint; and ``init_from`` of a checkpoint without REG's class-token layers into a REG run."""

from __future__ import annotations

import csv
import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from dit_lightning.cli import main
from dit_lightning.data import prepare_digits
from dit_lightning.data.extract import extract_features
from dit_lightning.models.repa import REPAOptions
from dit_lightning.module import DiTModule
from tests.helpers.cli import DEMO, TINY, fit_args, run_cli
from tests.helpers.reg_encoder import ClassTokenDigitsEncoder
from tests.helpers.training import TINY_MODULE

pytestmark = pytest.mark.usefixtures("one_thread")
ENCODER = "tests.helpers.reg_encoder.ClassTokenDigitsEncoder"
TOKEN_LAYERS = ("cls_embedder.", "final_layer.linear_cls.")


def test_a_reg_run_from_fit_to_export(tmp_path, capsys):
    torch.manual_seed(5)
    torch.save(ClassTokenDigitsEncoder().state_dict(), tmp_path / "encoder.pt")
    store = prepare_digits(str(tmp_path / "digits"))
    extract_features(
        store, ENCODER, repa_weights=str(tmp_path / "encoder.pt"), device="cpu", num_workers=0, progress=False
    )
    reg = [
        "--model.objective", "flow", "--model.repa.encoder", ENCODER,
        "--model.repa.weights", str(tmp_path / "encoder.pt"), "--model.repa.depth", "1",
        "--model.repa.projector_dim", "16", "--model.repa.class_token_weight", "0.03", "--model.repa.until_step", "3",
    ]  # fmt: skip
    grid = ["--sample_grid.enabled", "true", "--sample_grid.every_n_steps", "2", "--sample_grid.per_class", "1"]
    grid += ["--sample_grid.num_steps", "2"]
    signal = ["--trainer.callbacks+=tests.helpers.cli.SignalAtStep", "--trainer.callbacks.step", "2"]
    stopped = run_cli(fit_args(tmp_path, "run", 4, [*reg, *grid, *signal]), tmp_path, check=False)
    last = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "stopped by SIGTERM" in stopped.stdout and torch.load(last, weights_only=True)["global_step"] == 2

    main([*fit_args(tmp_path, "run", 4, [*reg, *grid]), "--ckpt_path", str(last)])  # the resume, in this process
    assert "resuming step 2" in capsys.readouterr().out
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r.get("train/loss")}
    assert sorted(rows) == [0, 1, 2, 3]
    terms = {s: {k: float(rows[s][f"train/{k}"]) for k in ("loss", "denoising", "repa", "class_token")} for s in rows}
    for step, t in terms.items():  # REG's token loss throughout, the alignment cut off at step 3 (until_step)
        alignment = 0.5 * t["repa"] if step < 3 else 0.0
        assert t["loss"] == pytest.approx(t["denoising"] + alignment + 0.03 * t["class_token"], rel=1e-5), step
    assert (tmp_path / "run" / "samples.png").is_file()  # the grid samples the token jointly
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 4 and ckpt["hyper_parameters"]["repa"]["class_token_weight"] == 0.03

    data = ["--data.path", store, "--trainer.logger", "false", "--ckpt_path", str(last)]
    scored = tmp_path / "test_metrics.json"
    evaluation = ["--evaluation.num_samples", "20", "--evaluation.num_steps", "3", "--evaluation.batch_size", "20"]
    main(["test", "--config", DEMO, *TINY, *reg, *data, *evaluation, "--evaluation.output", str(scored)])
    out = capsys.readouterr().out
    assert "test/class_token" in out and "test/digits_accuracy" in out and "test/digits_fd_svc" in out
    predict = [
        "--data.predict_labels", "3,7", "--data.predict_num_samples", "4", "--model.sample_steps", "3",
        "--trainer.callbacks+=dit_lightning.callbacks.PredictionWriter", "--trainer.callbacks.output_dir",
        str(tmp_path / "pred"),
    ]  # fmt: skip
    main(["predict", "--config", DEMO, *TINY, *reg, *data, *predict])
    assert sorted(p.name for p in (tmp_path / "pred").glob("*.png")) == [
        "000000-c3.png", "000001-c7.png", "000002-c3.png", "000003-c7.png",
    ]  # fmt: skip

    # the tools read the checkpoint alone (no encoder): the same keyed samples as `test`, so the same scores
    (tmp_path / "encoder.pt").unlink()
    tool = ["--checkpoint", str(last), "--vae", "none/pixels", "--num_steps", "3", "--progress", "false"]
    same_as_test = ["--num_samples", "20", "--labels", "0-9", "--batch_size", "20", "--cfg_scale", "2.0"]
    main(["sample", *tool, "--output", str(tmp_path / "samples"), "--labels", "3,7"])
    assert len(list((tmp_path / "samples" / "samples").rglob("*.png"))) == 2
    main(["evaluate", *tool, "--output", str(tmp_path / "eval"), "--metrics", "digits", *same_as_test])
    tested = json.loads(scored.read_text())["digits"]
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())["digits"]
    assert tested["samples"] == evaluated["samples"] == 20
    assert evaluated["per_class"] == tested["per_class"]
    assert evaluated["frechet"]["fd_svc"] == pytest.approx(tested["frechet"]["fd_svc"], rel=1e-4)

    main(
        ["export", "--checkpoint", str(last), "--output", str(tmp_path / "net.safetensors"), "--format", "safetensors"]
    )
    exported = load_file(tmp_path / "net.safetensors")
    ema = {k[len("ema.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("ema.")}
    assert any(k.startswith(TOKEN_LAYERS[0]) for k in exported) and any(k.startswith(TOKEN_LAYERS[1]) for k in exported)
    assert not any("repa" in k for k in exported)  # the projector trains beside the network, never samples
    assert exported.keys() == ema.keys() and all(torch.equal(exported[k], ema[k]) for k in ema)


def reg_module(tmp_path, init_from=None, class_token_weight=0.03):
    weights = tmp_path / "encoder.pt"
    if not weights.exists():
        torch.save(ClassTokenDigitsEncoder().state_dict(), weights)
    options = REPAOptions(
        encoder=ENCODER, weights=str(weights), depth=1, projector_dim=16, class_token_weight=class_token_weight
    )
    torch.manual_seed(0)
    return DiTModule(**TINY_MODULE, objective="flow", repa=options, init_from=init_from)


def test_init_from_a_checkpoint_without_the_class_token_starts_the_token_layers_at_regs_init(tmp_path, caplog):
    """A released SiT / DiT fine-tuned with REG: every weight of the network and of its EMA is the
    checkpoint's, the class-token layers (and only those may be missing) are REG's initialisation."""
    torch.manual_seed(1)
    plain = DiTModule(**TINY_MODULE, objective="flow")
    model = {k: torch.randn_like(v) for k, v in plain.model.state_dict().items()}
    ema = {k: torch.randn_like(v) for k, v in model.items()}
    torch.save({"model": model, "ema": ema, "args": {}}, tmp_path / "sit.pt")

    fresh = reg_module(tmp_path)
    with caplog.at_level(logging.INFO):
        tuned = reg_module(tmp_path, init_from=str(tmp_path / "sit.pt"))
    said = [r.getMessage() for r in caplog.records if "class-token layers" in r.getMessage()]
    assert len(said) == 1 and "cls_embedder.*, final_layer.linear_cls.* start at REG's initialisation" in said[0]
    for net, theirs in ((tuned.model, model), (tuned.ema, ema)):
        assert net is not None
        for k, v in net.state_dict().items():
            expected = fresh.model.state_dict()[k] if k.startswith(TOKEN_LAYERS) else theirs[k]
            assert torch.equal(v, expected), k
    assert not tuned.model.final_layer.linear_cls.weight.any()  # REG zeroes the token's output
    assert torch.isfinite(tuned.training_losses(batch_of(4), step=0)["loss"])

    del model["blocks.1.attn.proj.bias"]  # any other missing weight: refused as before
    torch.save({"model": model, "ema": ema, "args": {}}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"missing \['blocks.1.attn.proj.bias'\]"):
        reg_module(tmp_path, init_from=str(tmp_path / "partial.pt"))


def test_init_from_a_reg_checkpoint_into_a_run_without_reg_is_refused(tmp_path):
    torch.save(reg_module(tmp_path).model.state_dict(), tmp_path / "reg.pt")
    with pytest.raises(ValueError, match=r"class-token layers \(a token of width 64\).*class_token_weight 0.03"):
        reg_module(tmp_path, init_from=str(tmp_path / "reg.pt"), class_token_weight=0.0)


def batch_of(n):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 1, 8, 8, generator=g).clamp(-1, 1)
    return {"x": x, "y": torch.arange(n) % 10, "index": torch.arange(n)}
