"""Data: the same global batches on any mesh and host count; the text source reads the real files."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from orchestrator.config import ConfigError
from orchestrator.data import DOCUMENT_SEPARATOR, DataPipeline, TextSource
from orchestrator.step import batch_sharding
from orchestrator.train import make_mesh
from parallel.rules import resolve_rules
from tests.helpers import mesh_overrides


def pipeline(config) -> DataPipeline:
    mesh = make_mesh(config)
    return DataPipeline(config, batch_sharding(mesh, resolve_rules(config.mesh.rules)))


@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_global_batches_do_not_depend_on_mesh_or_host_count(tiny_config, source):
    one = tiny_config(f"data.source={source}").replace(**mesh_overrides(data=8))
    other = tiny_config(f"data.source={source}", "cluster.devices_per_host=4").replace(
        **mesh_overrides(fsdp=2, tensor=2))
    a, b = pipeline(one), pipeline(other)
    for step in (0, 3, 1000):
        batch = np.asarray(a.batch(step))
        for hosts in (1, 2, 4, 8):  # each simulated host builds only its rows
            assembled = np.concatenate([b.process_rows(step, p, hosts) for p in range(hosts)])
            np.testing.assert_array_equal(assembled, batch)
        assert batch.shape == (16, 33) and batch.dtype == np.int32
    assert not np.array_equal(np.asarray(a.batch(1)), np.asarray(a.batch(2)))


def test_text_rows_are_real_bytes_of_the_sorted_stdlib_sources(tiny_config):
    source = TextSource(tiny_config("data.source=text"))
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    assert source.files == stdlib
    corpus = b"".join(f.read_bytes() + bytes([DOCUMENT_SEPARATOR]) for f in stdlib)
    assert int(source.starts[-1]) == len(corpus)
    rows = source.rows(7, range(16))
    for row in range(16):
        window = source.window_index(7, row)
        expected = np.frombuffer(corpus[window * 33:(window + 1) * 33], np.uint8)
        np.testing.assert_array_equal(rows[row], expected)
    # One epoch visits every window once: the order is a permutation.
    order = [source.window_index(step, row) for step in range(source.num_windows // 16) for row in range(16)]
    assert len(set(order)) == len(order)


def test_iterator_state_round_trips_and_text_order_depends_on_seed(tiny_config):
    a = pipeline(tiny_config("data.source=text"))
    a.batch(0), a.batch(1)
    b = pipeline(tiny_config("data.source=text"))
    b.restore(a.state(), log=pytest.fail)
    assert b.next_step == 2
    reseeded = pipeline(tiny_config("data.source=text", "run.seed=1"))
    assert not np.array_equal(np.asarray(a.batch(2)), np.asarray(reseeded.batch(2)))


def test_missing_text_or_tokenizer_is_a_config_error(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match="data.paths"):
        TextSource(tiny_config("data.source=text", f"data.paths=[{tmp_path}/*.none]"))
    with pytest.raises(ConfigError, match="data.tokenizer"):
        TextSource(tiny_config("data.source=text", f"data.tokenizer={tmp_path}/absent.json"))
