"""Issue 11, item 8: `train-draft --resume` reads ckpt.pt / best.pt from the work folder with
PyTorch's weights-only unpickler, so a planted file cannot run code."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from export.draft.train import TrainConfig, load_checkpoint, train  # noqa: E402
from export.errors import CorruptSourceError  # noqa: E402

pytestmark = pytest.mark.export


class _Evil:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):  # unpickling this calls os.mkdir(path)
        return os.mkdir, (self.path,)


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(4, 2))  # as EagleHead.embed


def test_real_checkpoints_load_weights_only(tmp_path):
    """What train() saves (head, AdamW, LambdaLR, progress) is tensors and plain containers."""
    head = _Head()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
    head.embed.sum().backward()
    opt.step()
    sched.step()
    state = {"step": 1, "tokens": 10, "best": 0.5, "curve": [{"step": 1, "tokens": 10, "val": [0.5]}]}
    path = tmp_path / "ckpt.pt"
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "state": state}, path)
    saved = load_checkpoint(path)
    assert saved["state"] == state and torch.equal(saved["head"]["embed"], head.embed)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])


@pytest.mark.parametrize("name", ["ckpt.pt", "best.pt"])
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path, name):
    """Was: torch.load(..., weights_only=False) ran whatever the pickle said."""
    sentinel = tmp_path / "pwned"
    path = tmp_path / name
    torch.save({"head": _Evil(sentinel)}, path)
    with pytest.raises(CorruptSourceError, match="not a plain tensor checkpoint"):
        load_checkpoint(path)
    assert not sentinel.exists()


def test_resume_with_a_planted_checkpoint(tmp_path):
    sentinel = tmp_path / "pwned"
    torch.save(_Evil(sentinel), tmp_path / "ckpt.pt")
    with pytest.raises(CorruptSourceError, match="ckpt.pt"):
        train(_Head(), [], [], TrainConfig(), work=tmp_path, should_stop=None, log=lambda s: None)
    assert not sentinel.exists()


def test_garbage_checkpoint_is_a_one_line_error(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CorruptSourceError):
        load_checkpoint(tmp_path / "ckpt.pt")
