"""task2_batching/probes/profile_packed_probe.py (CUDA only): with the attention block lists
built by the loader or on the GPU, the records it builds from measured times are those the
task-2 report reads; a bad flag or a CPU is refused in one line."""

import dataclasses

import pytest
import torch

from effdl.results import read_records
from tests.probe_logs import COMMITTED, assert_like_committed, probe_log, refused
from tests.script_loading import load_script

probe = load_script("task2_batching/probes", "profile_packed_probe")
LOG = "profile_packed.jsonl"


def built_by(where: str):
    return lambda record: record["config"]["attention_blocks_built"] == where


@pytest.mark.parametrize("where", probe.BUILT_BY)
def test_records_from_measured_times_have_the_committed_keys(tmp_path, where):
    cfg = dataclasses.replace(probe.FULL, attention_blocks=where)
    log = probe_log(tmp_path, LOG, "task2_profile_packed")
    batches = [{"input_ids": torch.zeros(64, 640, dtype=torch.long)}]
    metrics = probe.forward_metrics([0.002] * 4, [4.0, 4.2, 4.4, 4.1], 16_000.0)
    assert metrics == {"cpu_launch_ms_median": 2.0, "event_ms_median": pytest.approx(4.15),
                       "gpu_kernel_ms_per_batch": 4.0}  # fmt: skip
    for variant in probe.VARIANTS:
        probe.log_variant(log, cfg, variant, batches, metrics)
    records = assert_like_committed(tmp_path / LOG, f"task2/probes/{LOG}", built_by(where))
    assert {r["config"]["attention_blocks_built"] for r in records} == {where}
    assert records[0]["config"]["shape"] == [64, 640]


def test_the_probe_runs_every_committed_variant():
    names = {r["variant"] for r in read_records(COMMITTED / "task2/probes" / LOG)}
    assert names == set(probe.VARIANTS)


class BlockSizes:
    def loader_block_size(self, device):
        return 128


@pytest.mark.parametrize(("where", "size"), [("loader", 128), ("gpu", None)])
def test_the_flag_decides_whether_the_loader_builds_block_lists(where, size):
    cfg = dataclasses.replace(probe.FULL, attention_blocks=where)
    assert probe.loader_blocks(cfg, BlockSizes(), torch.device("cpu")) == size


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--batches", "0"], "--batches must be >= 1"),
        (["--attention-blocks", "cpu"], "--attention-blocks: invalid choice"),
        (["--device", "cpu"], "needs CUDA"),
    ],
)
def test_a_bad_flag_or_a_cpu_is_refused_before_any_log(tmp_path, monkeypatch, capsys, argv, says):
    assert says in refused(probe, argv, tmp_path / "out", monkeypatch, capsys)
