"""Checkpoints and REPA encoder weights share one weights-only reader (``safe_read.read_weights``):
a pickle naming code is refused in the project's words (never torch's paragraph on how to load it
anyway) with the file's name, and nothing runs."""

from pathlib import Path

import pytest
import torch

from dit_lightning.checkpoints import UnsafeFileError, read_checkpoint
from dit_lightning.checkpoints.safe_load import load_file
from dit_lightning.safe_read import FileKind, read_state_dict


class System:
    """Unpickling this calls ``os.system`` with a command that creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {marker}"

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


def test_a_checkpoint_naming_code_is_refused_by_the_shared_reader(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "model.pt"
    torch.save({"model": {"x_embedder.proj.weight": System(marker)}}, path)
    for read in (read_checkpoint, load_file):
        with pytest.raises(UnsafeFileError) as raised:
            read(path)
        message = str(raised.value)
        assert message.startswith(f"checkpoint '{path}' names code (") and "system) that unpickling it" in message
        assert "weights_only=False" not in message and "trust" not in message and "\n" not in message, message
    with pytest.raises(UnsafeFileError, match=f"^encoder '{path}' names code"):  # the same reader, another file kind
        read_state_dict(path, FileKind("encoder", "weights file", "Check it."))
    assert not marker.exists()
    with pytest.raises(FileNotFoundError, match=f"checkpoint '{tmp_path / 'missing.pt'}' does not exist"):
        load_file(tmp_path / "missing.pt")
