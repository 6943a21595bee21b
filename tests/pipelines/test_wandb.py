"""``trainer.loggers=["wandb"]``: every metrics row reaches a Weights & Biases run, offline (no network), read
back from the run's own ``.wandb`` file; unknown loggers are config errors."""

from __future__ import annotations

import json
import struct

import pytest

from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.observe.metrics import MetricsWriter
from asyncrl.pipelines.job.presets import tiny_test

BLOCK = 32768


def wandb_records(path) -> list:
    """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log records (crc32, length, type) in 32 KiB blocks, a record split across blocks as
    FIRST/MIDDLE/LAST."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, out, parts = 7, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def test_every_row_reaches_an_offline_wandb_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    rows = [{"reward/mean": 0.1 * s, "time/step": 0.5 + s, "staleness/max": s % 2, "note": "text"} for s in range(3)]
    w = MetricsWriter(tmp_path / "run", tensorboard=False, loggers=["wandb"], config={"trainer": {"steps": 3}})
    for s, row in enumerate(rows):
        w.write(s, row)
    w.write(3, {"kind": "eval", "eval/version": 3, "eval/reward_mean": 0.75})
    w.close()
    wandb.teardown()  # the service process writes the file on its own: teardown waits for it to finish
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history = []
    config = {}
    for rec in wandb_records(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "run":
            assert rec.run.project == "asyncrl" and rec.run.display_name == "run"
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    assert [h["_step"] for h in history] == [0, 1, 2, 3]
    for h, row in zip(history, rows):
        assert {k: h[k] for k in ("reward/mean", "time/step", "staleness/max")} == {
            k: row[k] for k in ("reward/mean", "time/step", "staleness/max")}
        assert "note" not in h  # scalars only, as TensorBoard gets
    assert history[3]["eval/reward_mean"] == 0.75
    assert config["trainer"] == {"steps": 3}


def test_an_unknown_logger_is_a_config_error():
    cfg = tiny_test()
    cfg.trainer.loggers = ["mlflow"]
    with pytest.raises(ConfigError, match="trainer.loggers: unknown logger 'mlflow'"):
        cfg.validate()
