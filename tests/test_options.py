"""RemoteLoader's arguments reach LoaderOptions (client/options.py), each checked once by name.

A new option is a parameter of RemoteLoader (with its default and doc), its check in
``LoaderOptions.from_arguments`` and its field: these tests fail when one of the three is
forgotten, without a server.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from remoteloader.client import RemoteLoader
from remoteloader.client.options import LoaderOptions, Option

pytestmark = pytest.mark.timeout(60)


def defaults() -> dict:
    """RemoteLoader's arguments as its signature gives them, the address left out."""
    parameters = inspect.signature(RemoteLoader.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name not in ("self", "address")}


def test_every_argument_of_the_loader_is_checked_and_nothing_else_is_taken():
    arguments = defaults()
    options = LoaderOptions.from_arguments(arguments)
    assert options.batch_size == arguments["batch_size"] and options.image_size == (224, 224)
    for name in arguments:  # each one is taken: a mapping without it is refused, naming it
        with pytest.raises(TypeError, match=repr(name)):
            LoaderOptions.from_arguments({k: v for k, v in arguments.items() if k != name})
    with pytest.raises(TypeError, match="no check for colour"):
        LoaderOptions.from_arguments({**arguments, "colour": "red"})


def test_the_loaders_read_only_attributes_are_fields_of_its_options():
    fields = {f.name for f in dataclasses.fields(LoaderOptions)}
    attributes = {name for name, value in vars(RemoteLoader).items() if isinstance(value, Option)}
    assert attributes and attributes <= fields, attributes - fields
    # ... and every argument that is not one has a field of its own, or a documented home.
    # (pipeline: in options.setup; the clip arguments: in options.clip, client/clips.py)
    homed = {"pipeline", "clip_frames", "frame_stride", "clips_per_video", "video_layout"}
    assert set(defaults()) - fields <= homed, set(defaults()) - fields
