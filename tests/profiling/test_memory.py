import os

import pytest

from effdl.profiling import memory


def test_expandable_segments_are_set_unless_the_user_chose(monkeypatch):
    monkeypatch.setenv(memory.ALLOC_CONF, "")
    monkeypatch.delenv(memory.ALLOC_CONF)
    monkeypatch.setattr(memory.torch.cuda, "is_initialized", lambda: False)
    assert memory.use_expandable_segments() == memory.EXPANDABLE
    assert os.environ[memory.ALLOC_CONF] == memory.EXPANDABLE
    monkeypatch.setenv(memory.ALLOC_CONF, "max_split_size_mb:128")
    assert memory.use_expandable_segments() == "max_split_size_mb:128"


def test_too_late_once_cuda_started_is_said(monkeypatch):
    monkeypatch.setenv(memory.ALLOC_CONF, "")
    monkeypatch.delenv(memory.ALLOC_CONF)
    monkeypatch.setattr(memory.torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA started before"):
        assert memory.use_expandable_segments() == ""
    assert memory.ALLOC_CONF not in os.environ
