"""`dit-lightning consolidate` after a real sharded run of the CLI. (The consolidation tests of
the distributed parity runs live with them in tests/distributed/test_distributed.py, so those
runs happen once.)"""

import torch

from dit_lightning.checkpoints import is_sharded_checkpoint, read_checkpoint
from dit_lightning.commands.consolidate import consolidate
from dit_lightning.models import DiT
from tests.helpers.cli import ROOT


def test_cli_fit_with_the_fsdp2_cpu_profile_then_consolidate(tmp_path):
    """`dit-lightning fit --config demo --config configs/hardware/fsdp-v2-cpu.yaml` trains on 2
    processes, writes sharded checkpoint directories (periodic and last.ckpt), which
    consolidate into a file the sampling tools read."""
    from tests.helpers.cli import fit_args, run_cli

    profile = str(ROOT / "configs" / "hardware" / "fsdp-v2-cpu.yaml")
    args = fit_args(
        tmp_path, "fsdp", 4, ["--config", profile, "--trainer.callbacks=[]", "--checkpoint.every_n_train_steps", "2"]
    )
    proc = run_cli(args, tmp_path)
    assert "FSDP2: sharded" in proc.stdout + proc.stderr
    last = tmp_path / "fsdp" / "ckpt" / "last.ckpt"
    assert is_sharded_checkpoint(last), sorted(p.name for p in (tmp_path / "fsdp" / "ckpt").iterdir())
    obj = torch.load(consolidate(str(last), str(tmp_path / "dit.pt")), weights_only=True)
    assert obj["args"]["global_step"] == 4
    net = DiT(**{**obj["args"]["model_config"], "num_heads": obj["args"]["num_heads"]})
    net.load_state_dict(obj["ema"], strict=True)
    assert read_checkpoint(tmp_path / "dit.pt").ema.keys() == obj["ema"].keys()
