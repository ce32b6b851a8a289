"""reports/loaders/replicates.py: the provenance of a log's records, as the appendices caption it."""

import numpy as np
import pandas as pd

from tests.script_loading import load_script

replicates = load_script("reports/loaders", "replicates")


def test_provenance_lists_each_value_once_sorted_and_skips_missing():
    frame = pd.DataFrame({
        "env.gpu": ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H200"],
        "env.gpu_id": ["b2", np.nan, "a1"],
        "env.git_sha": ["7abdface5", "7abdface5", "0123456789"],
    })  # fmt: skip
    got = replicates.provenance(frame)
    assert got == {
        "GPU": ["NVIDIA H100 80GB HBM3", "NVIDIA H200"],
        "host id": ["a1", "b2"],
        "git sha": ["0123456", "7abdfac"],
    }


def test_provenance_of_a_log_without_host_or_commit_fields():
    got = replicates.provenance(pd.DataFrame({"env.gpu": ["NVIDIA H200"]}))
    assert got["host id"] == [] and got["git sha"] == []
    assert got["GPU"] == ["NVIDIA H200"]
