"""RemoteLoader's options (client/options.py, client/option_groups.py): one declaration each.

An option is one field of one group, with its default, its doc and its check; RemoteLoader's
signature, its docstring and its read-only attributes come from the fields. These tests fail
when one of them does not, without a server.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from remoteloader.client import RemoteLoader
from remoteloader.client.options import (
    GROUPS,
    READ_BACK,
    LoaderOptions,
    OnError,
    OutputOptions,
    ReceiverKind,
    Wire,
)

pytestmark = pytest.mark.timeout(60)


def defaults() -> dict:
    """RemoteLoader's arguments as its signature gives them, the address left out."""
    parameters = inspect.signature(RemoteLoader.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name not in ("self", "address")}


def test_every_argument_of_the_loader_is_checked_and_nothing_else_is_taken():
    arguments = defaults()
    options = LoaderOptions.from_arguments(arguments)
    assert options.batches.batch_size == arguments["batch_size"] and options.batches.image_size == (224, 224)
    assert LoaderOptions.from_arguments({}) == options  # the signature's defaults are the groups' own
    with pytest.raises(TypeError, match="colour"):
        LoaderOptions.from_arguments({**arguments, "colour": "red"})
    with pytest.raises(TypeError, match="colour"):
        RemoteLoader("127.0.0.1:1", colour="red")
    with pytest.raises(TypeError):
        RemoteLoader("127.0.0.1:1", 256)  # keywords only, as before


def test_the_signature_lists_each_field_of_each_group_once_with_its_default():
    parameters = inspect.signature(RemoteLoader.__init__).parameters
    fields = [f for group in GROUPS for f in dataclasses.fields(group)]
    assert [f.name for f in fields] == list(parameters)[2:]
    for f in fields:
        assert parameters[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[f.name].default == f.default, f.name
        assert f.metadata["doc"] and f"{f.name}: " in RemoteLoader.__doc__, f.name  # the docstring says it


def test_every_field_is_checked_naming_it():
    bad = {"batch_size": 0, "image_size": 0, "pipeline": 3, "seed": -1, "world_size": 0, "device": "meta",
           "normalize": (1, 2), "dtype": torch.int8, "fields": "bboxes", "batch_format": "coco", "on_error": "shout",
           "receiver": "pipe", "prefetch": 0, "progress_timeout": 0, "max_inflight": 0, "connect_timeout": -1,
           "reconnect_timeout": "x", "wire": "gzip", "job": "", "tls": 5, "token": "", "clip_frames": 0,
           "frame_stride": 0, "clips_per_video": 0, "video_layout": "TCHW"}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            LoaderOptions.from_arguments({name: value})
    with pytest.raises(ValueError, match="rank=2"):
        LoaderOptions.from_arguments({"rank": 2, "world_size": 2})


def test_names_become_enums_and_strings_still_compare():
    options = LoaderOptions.from_arguments({"on_error": "skip", "wire": "raw", "receiver": "process"})
    assert options.output.on_error is OnError.SKIP and options.output.on_error == "skip"
    assert options.connection.wire is Wire.RAW and options.setup.wire == "raw"
    assert options.output.receiver is ReceiverKind.PROCESS
    assert OutputOptions().receiver is ReceiverKind.THREAD  # the default on the CPU
    assert callable(LoaderOptions.from_arguments({"on_error": print}).output.on_error)


def test_the_loaders_read_only_attributes_are_its_options():
    assert "batch_size" in READ_BACK and "sampler" not in READ_BACK
    for name in READ_BACK:
        assert hasattr(RemoteLoader, name), name
    # ... and the setup the streams send is made from them
    options = LoaderOptions.from_arguments({"fields": ["label", "mask"], "job": "sweep", "share": False})
    assert list(options.setup.fields) == ["mask"] and options.setup.job == "sweep" and options.setup.exclusive
    assert options.masks and list(options.with_fields(["bboxes"]).setup.fields) == ["mask"]  # fields given win
    assert list(LoaderOptions.from_arguments({}).with_fields(["label", "bboxes"]).setup.fields) == ["bboxes"]
