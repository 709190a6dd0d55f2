"""Writing checkpoints: Lightning checkpoints exported to the reference and raw formats, and
pruned networks saved as files of their new shape."""

import pytest
import torch
from torch.utils.data import DataLoader

from dit_lightning.checkpoints import dit_config_of, export_checkpoint, infer_dit_config, load_dit, read_checkpoint
from dit_lightning.checkpoints import save_dit as save_pruned
from dit_lightning.models import DiT, model_config
from dit_lightning.models.pruning import prune_depth, prune_mlp
from dit_lightning.module import DiTModule
from tests.helpers.models import inputs, randomized
from tests.helpers.training import TINY_MODULE as TINY
from tests.helpers.training import DictDataset, trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lightning_checkpoint_loads_weights_only_and_exports_to_reference_format(tmp_path):
    module = DiTModule(**TINY, ema_decay=0.5)
    t = trainer(max_steps=2, default_root_dir=tmp_path)
    t.fit(module, DataLoader(DictDataset(), batch_size=8))
    ckpt = tmp_path / "run.ckpt"
    t.save_checkpoint(ckpt)
    raw = torch.load(ckpt, weights_only=True)  # no pickled objects in our checkpoints
    assert raw["global_step"] == 2
    restored = DiTModule.load_from_checkpoint(ckpt, weights_only=True)
    for a, b in zip(module.ema.parameters(), restored.ema.parameters()):
        assert torch.equal(a, b)

    ref = tmp_path / "ref.pt"
    export_checkpoint(str(ckpt), str(ref))
    out = torch.load(ref, weights_only=True)
    assert set(out) == {"model", "ema", "opt", "args"}
    plain = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    plain.load_state_dict(out["ema"], strict=True)
    for a, b in zip(plain.parameters(), module.ema.parameters()):
        assert torch.equal(a, b)
    assert out["args"]["model_config"]["depth"] == 2

    raw_path = tmp_path / "raw.pt"
    export_checkpoint(str(ckpt), str(raw_path), format="raw")
    assert read_checkpoint(raw_path).model.keys() == plain.state_dict().keys()


def test_pruned_file_saves_and_loads_as_a_dit_of_its_new_shape(tmp_path):
    model = randomized()
    pruned = prune_mlp(prune_depth(model, [0, 2]), keep_ratio=0.5)
    path = save_pruned(pruned, tmp_path / "pruned.pt", ema=pruned)
    ckpt = read_checkpoint(path)
    inferred = infer_dit_config(ckpt.model)
    assert (inferred["depth"], inferred["mlp_ratio"]) == (2, 2.0)
    assert dit_config_of(ckpt)[0] == {**model_config(pruned)}
    loaded = load_dit(str(path)).net
    x, t, y = inputs()
    assert torch.equal(loaded(x, t, y), pruned(x, t, y))
    # ... and DiTModule fine-tunes it through init_from, configured with the new shape.
    module = DiTModule(
        model="custom",
        latent_shape=(4, 8, 8),
        num_classes=10,
        depth=2,
        hidden_size=32,
        num_heads=4,
        mlp_ratio=2.0,
        init_from=str(path),
    ).eval()
    assert torch.equal(module.model(x, t, y), pruned(x, t, y))
