"""`dit-lightning export` on the command line: every format, the scheduler choice of a diffusers
export, and the sampler names of `sample` (diffusers' schedulers) parsed from the command line."""

import json

import pytest
import torch

from dit_lightning.checkpoints import read_checkpoint, save_dit
from dit_lightning.cli import main
from tests.helpers.models import random_dit, tiny_dit_kwargs

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*accelerate.*")]


def test_export_command_writes_every_format(tmp_path, capsys):
    net = random_dit(in_channels=1)
    ckpt = str(save_dit(net, tmp_path / "n.pt", ema=net, extra_args={"vae": "none/pixels"}))
    out = tmp_path / "pipe"
    main(["export", "--checkpoint", ckpt, "--output", str(out), "--format", "diffusers", "--scheduler", "unipc"])
    assert json.loads((out / "model_index.json").read_text())["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    said = capsys.readouterr()
    assert "no store known" in said.err  # the notes reach the user
    # what the export does not hold is said on the console, not only in the export's README
    assert "  left out: vae/ (a pixel model: it generates pixels, there is nothing to decode)" in said.out
    main(["export", "--checkpoint", str(out), "--output", str(tmp_path / "w.safetensors"), "--format", "safetensors"])
    main(["export", "--checkpoint", str(tmp_path / "w.safetensors"), "--output", str(tmp_path / "r.pt")])
    for path in (out, tmp_path / "w.safetensors", tmp_path / "r.pt"):
        sd = read_checkpoint(path).weights()
        assert all(torch.equal(sd[k], v) for k, v in net.state_dict().items())
    with pytest.raises(SystemExit):  # jsonargparse: not one of the schedulers
        main(["export", "--checkpoint", ckpt, "--output", str(tmp_path / "x"), "--format", "diffusers",
              "--scheduler", "ddpm"])  # fmt: skip


def test_an_export_of_a_repa_run_says_it_leaves_the_projector_out(tmp_path, capsys):
    net = random_dit(in_channels=1)
    state = {f"{prefix}.{k}": v for prefix in ("model", "ema") for k, v in net.state_dict().items()}
    state["repa_projector.0.weight"] = torch.zeros(8, 32)  # REPA's projector trains beside the DiT
    hparams = {"model": "custom", **tiny_dit_kwargs(in_channels=1), "vae": "none/pixels", "repa": {"depth": 1}}
    ckpt = tmp_path / "repa.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": hparams, "global_step": 3, "epoch": 0}, ckpt)
    for form, out in (("reference", "r.pt"), ("safetensors", "w.safetensors")):
        main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / out), "--format", form])
        assert "  left out: the REPA projector (training only: sampling never uses it)" in capsys.readouterr().out
    main(["export", "--checkpoint", str(tmp_path / "r.pt"), "--output", str(tmp_path / "again.pt")])
    assert "left out" not in capsys.readouterr().out  # nothing more to leave out


def test_sample_command_line_takes_the_diffusers_sampler_names(tmp_path):
    net = random_dit(in_channels=1)
    ckpt = str(save_dit(net, tmp_path / "n.pt", ema=net))
    for sampler in ("dpm++2m", "euler-a"):
        out = tmp_path / sampler
        main(["sample", "--checkpoint", ckpt, "--output", str(out), "--labels", "1,2", "--sampler", sampler,
              "--num_steps", "3", "--progress", "false", "--device", "cpu"])  # fmt: skip
        assert json.loads((out / "sample_config.json").read_text())["sampler"] == sampler
