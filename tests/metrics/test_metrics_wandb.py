"""The W&B writer in offline mode, for real (no network): the run file is read back record by record."""

import json
import pathlib
import struct
import time

import pytest

from rljax.metrics import MetricsLogger

wandb = pytest.importorskip("wandb")  # optional dependency; test_metrics_logger covers the missing case
from wandb.proto import wandb_internal_pb2  # noqa: E402

_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of [crc32 u32, length u16, type u8]
_HEADER = 7  # ":W&B" + magic u16 + version u8


def wandb_records(path: pathlib.Path) -> list:
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, chunks = [], _HEADER, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # block trailer too short for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(chunks)
            records.append(rec)
            chunks = b""
        elif kind == 0:
            break
    return records


def finished_records(path: pathlib.Path, wait_s: float = 60.0) -> list:
    """The run file's records once its `exit` record is on disk: `run.finish()` can return while wandb's
    service process is still writing the file."""
    deadline = time.monotonic() + wait_s
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def history(path: pathlib.Path) -> dict[int, dict]:
    out = {}
    for rec in finished_records(path):
        if rec.WhichOneof("record_type") == "history":
            items: dict = {}
            for item in rec.history.item:  # a histogram comes as items keyed (name, "values"), (name, "bins")
                *parents, leaf = [item.key] if item.key else list(item.nested_key)
                node = items
                for key in parents:
                    node = node.setdefault(key, {})
                node[leaf] = json.loads(item.value_json)
            out[int(items["_step"])] = items
    return out


def test_wandb_offline_run_holds_the_logged_steps(tmp_path):
    settings = {"project": "rljax-test", "mode": "offline", "name": "tiny", "config": {"algo": "grpo"}}
    with MetricsLogger(tmp_path, console=False, tensorboard=False, wandb=settings) as logger:
        for step in range(3):
            logger.write(step, {"reward/mean": 0.5 * step, "compile/count": 1, "staleness/hist": [2, step]})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    run_files = list((tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
    assert len(run_files) == 1
    hist = history(run_files[0])
    assert sorted(hist) == [0, 1, 2]
    assert [hist[s]["reward/mean"] for s in range(3)] == [0.0, 0.5, 1.0]
    assert hist[1]["compile/count"] == 1
    staleness = hist[2]["staleness/hist"]
    assert staleness["_type"] == "histogram" and staleness["values"] == [2, 2]
    assert staleness["bins"] == [-0.5, 0.5, 1.5]


def test_wandb_resume_continues_the_same_run(tmp_path):
    settings = {"project": "rljax-test", "mode": "offline"}
    with MetricsLogger(tmp_path, console=False, tensorboard=False, wandb=settings) as logger:
        logger.write(0, {"reward/mean": 1.0})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    with MetricsLogger(tmp_path, console=False, tensorboard=False, wandb=settings, resume_step=1) as logger:
        logger.write(1, {"reward/mean": 2.0})
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id
    run_files = sorted((tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
    steps = sorted(s for f in run_files for s in history(f))
    assert steps == [0, 1]
    with MetricsLogger(tmp_path / "fresh", console=False, tensorboard=False, wandb=settings) as logger:
        logger.write(0, {"reward/mean": 1.0})
    assert (tmp_path / "fresh" / "wandb_run_id").read_text().strip() != run_id
