"""`dit-lightning prune`: calibrated block selection, the pruning report, and pruned files that
fine-tune through ``init_from``."""

import pytest
import torch

from dit_lightning.checkpoints import load_dit, read_checkpoint
from dit_lightning.checkpoints import save_dit as save_pruned
from dit_lightning.commands.prune import prune
from dit_lightning.models import DiTShape, dit_params
from dit_lightning.module import DiTModule
from tests.helpers.models import inputs, randomized

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prune_tool_with_calibration(tmp_path):
    from dit_lightning.data import prepare_digits

    store = prepare_digits(str(tmp_path / "digits"))
    model = randomized(in_channels=1)
    src = save_pruned(model, tmp_path / "full.pt", ema=model, extra_args={"num_heads": 4})
    out = prune(
        src,
        str(tmp_path / "small.pt"),
        depth=2,
        mlp_ratio=1.0,
        calibration=store,
        calibration_size=16,
        calibration_draws=1,
    )
    ckpt = read_checkpoint(out)
    report = ckpt.args["pruning"]
    assert len(report["block_importance"]) == 3 and len(report["kept_blocks"]) == 2
    assert report["params_after"] < report["params_before"]
    small = load_dit(out).net
    assert (small.depth, small.blocks[0].mlp.fc1.out_features, small.num_heads) == (2, 32, 4)


def test_head_pruned_file_fine_tunes_through_init_from(tmp_path):
    model = randomized()
    src = save_pruned(model, tmp_path / "full.pt", ema=model)
    out = prune(src, str(tmp_path / "small.pt"), heads=2)
    small = load_dit(out).net
    assert (small.num_heads, small.blocks[0].attn.head_dim) == (2, 8)
    assert sum(p.numel() for p in small.parameters()) == dit_params(DiTShape.of(small))
    module = DiTModule(
        model="custom",
        latent_shape=(4, 8, 8),
        num_classes=10,
        depth=3,
        hidden_size=32,
        num_heads=2,
        attn_dim=16,
        init_from=out,
    ).eval()
    x, t, y = inputs()
    assert torch.equal(module.model(x, t, y), small(x, t, y))


def test_calibration_of_a_reg_network_is_refused_before_any_work(tmp_path):
    model = randomized(in_channels=1, learn_sigma=False, class_token_dim=8)
    src = save_pruned(model, tmp_path / "reg.pt", ema=model, extra_args={"num_heads": 4})
    with pytest.raises(ValueError, match=r"REG's class token \(class_token_dim 8\): prune it by weight magnitude"):
        prune(src, str(tmp_path / "small.pt"), depth=2, calibration=str(tmp_path / "no-store"))
    assert not (tmp_path / "small.pt").exists()
    # by magnitude it prunes, and the token's layers stay
    small = load_dit(prune(src, str(tmp_path / "small.pt"), depth=2)).net
    assert small.depth == 2 and small.class_token_dim == 8
