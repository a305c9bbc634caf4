"""ServerConfig (server/config.py): settings given as text are parsed once, there, and kept parsed."""

from __future__ import annotations

import argparse
import struct

import pytest

from remoteloader.protos.jobs import parse_weights
from remoteloader.server import config as config_module
from remoteloader.server.config import ServerConfig
from remoteloader.server.formats import FormatOptions, open_shards


def _parsed(argv: list[str]) -> ServerConfig:
    parser = argparse.ArgumentParser()
    config_module.add_arguments(parser)
    return config_module.from_args(parser.parse_args(argv))


def test_text_settings_are_kept_parsed_from_flags_variables_and_code(monkeypatch):
    config = _parsed(["--data", "d", "--job-weights", "sweep=3, probe=0.5",
                      "--tfrecord-features", '{"image": "jpeg"}', "--parquet-columns", '{"label": "y"}'])
    assert config.job_weights == {"sweep": 3.0, "probe": 0.5}
    assert config.tfrecord_features == {"image": "jpeg"} and config.parquet_columns == {"label": "y"}
    monkeypatch.setenv("REMOTELOADER_JOB_WEIGHTS", "a=2")
    assert _parsed(["--data", "d"]).job_weights == {"a": 2.0}
    monkeypatch.delenv("REMOTELOADER_JOB_WEIGHTS")
    # none given: empty, not text
    plain = _parsed(["--data", "d"])
    assert plain.job_weights == {} and plain.tfrecord_features == {} and plain.parquet_columns == {}
    # given parsed in code: checked as the text is, and kept equal
    assert ServerConfig(data=("d",), job_weights={"a": 2.0}).job_weights == {"a": 2.0}
    with pytest.raises(ValueError, match="from 0.001 to 1000"):
        ServerConfig(data=("d",), job_weights={"a": 0.0})
    with pytest.raises(ValueError, match="parquet_columns=.*nope not among"):
        ServerConfig(data=("d",), parquet_columns={"nope": "x"})


@pytest.mark.parametrize(("flag", "value", "reason"), [
    ("--job-weights", "sweep", "job_weights: 'sweep': expected NAME=WEIGHT"),
    ("--tfrecord-features", "{not json", "tfrecord_features='{not json' is not JSON"),
    ("--tfrecord-features", '{"picture": "x"}', "tfrecord_features=.*picture not among"),
    ("--parquet-columns", '["image"]', "parquet_columns=.*expected a JSON object"),
    ("--parquet-columns", '{"bbox_format": "yolo"}', "bbox_format is one of"),
])
def test_a_bad_text_setting_is_refused_at_start_naming_the_setting(flag, value, reason):
    with pytest.raises(ValueError, match=reason):
        _parsed(["--data", "d", flag, value])


def test_help_shows_no_parsed_default():
    parser = argparse.ArgumentParser()
    config_module.add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    for name in ("job_weights", "tfrecord_features", "parquet_columns"):
        assert "(default" not in helps[name] and helps[name].endswith(f"[env REMOTELOADER_{name.upper()}]")


def test_the_formats_read_the_parsed_settings_from_the_config(tmp_path):
    from remoteloader.server.formats import tfrecord

    example = bytes([0x0A, 0x00])  # an Example with empty Features
    record = struct.pack("<Q", len(example))
    record += struct.pack("<I", tfrecord.masked_crc(record)) + example + struct.pack("<I", tfrecord.masked_crc(example))
    (tmp_path / "a.tfrecord").write_bytes(record)
    config = ServerConfig(data=(str(tmp_path / "a.tfrecord"),), cache_dir=str(tmp_path / "cache"),
                          tfrecord_features='{"image": "jpeg"}')
    options = FormatOptions.of(config)
    assert options.config is config and options.index_folder == str(tmp_path / "cache" / "indexes")
    (shard,) = open_shards(list(config.data), options)
    assert "no 'jpeg' feature" in shard.failure(0)


def test_job_weights_are_checked_where_the_operator_gives_them():
    assert parse_weights("sweep=3, probe=0.5") == {"sweep": 3.0, "probe": 0.5}
    for bad, reason in [
        ("sweep", "NAME=WEIGHT"),
        ("sweep=0", "from 0.001 to 1000"),
        ("a=1e-320", "from 0.001"),
        ("a=nan", "from 0.001"),
        ("a=1e4", "to 1000"),
        ("a=1,a=2", "twice"),
        ("a b=1", "letters"),
        ("=2", "empty"),
    ]:
        with pytest.raises(ValueError, match=reason):
            ServerConfig(data=("/tmp",), job_weights=bad)
