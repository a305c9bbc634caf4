"""``--source package.module:factory``: samples from the operator's own Python object.

The object is built by calling ``factory(**json.loads(--source-args))`` in the server and in
each decode worker; the code is the operator's, named on the server's own command line,
never sent by a client. It provides:

* ``len(obj)``: the number of samples;
* ``obj.key(i)``: a sample's name (a UTF-8 string, unique in the source);
* ``obj.sample(i)``: ``(image, targets)``: the encoded image (JPEG or PNG bytes) or a decoded
  uint8 RGB array [H, W, 3], and a mapping of the target fields (``targets.py``);
* optionally ``obj.labels``: every sample's class label (a sequence of ints, read once at
  start-up; the "label" field), ``obj.class_names`` and ``obj.fields`` (the target fields its
  samples carry; otherwise those of sample 0).

Two servers running the same source with the same arguments, over the same keys, are
replicas of one shard (the same id): failover and exactly-once epochs hold across them.
"""

from __future__ import annotations

import hashlib
import importlib
import json

import numpy as np

from remoteloader.server import targets as tg
from remoteloader.server.catalog import CatalogError, KeyTable, Location, Shard


class SourceError(ValueError):
    """The source cannot be loaded or does not keep its contract."""


def load_source(spec: str, args_json: str) -> object:
    """The object ``package.module:factory`` makes from the JSON keyword arguments."""
    module_name, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise SourceError(f"--source {spec}: cannot load it: {type(exc).__name__}: {exc}") from None
    try:
        source = factory(**json.loads(args_json or "{}"))
    except Exception as exc:
        raise SourceError(f"--source {spec}: the factory raised {type(exc).__name__}: {exc}") from None
    for method in ("key", "sample"):
        if not callable(getattr(source, method, None)):
            raise SourceError(f"--source {spec}: the object it returns has no {method}() method")
    return source


class SourceShard(Shard):
    """The samples of a ``--source`` object: keys and labels indexed at start, the rest asked for
    when a sample is served (by the decode workers' own copies of the object)."""

    def __init__(self, source: object, spec: str, args_json: str, position: int = 0):
        self.source = position
        try:
            count = len(source)  # type: ignore[arg-type]
        except Exception as exc:
            raise SourceError(f"--source {spec}: len() of its object failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(count, int) or count < 1:
            raise SourceError(f"--source {spec}: its object holds {count!r} samples; expected at least one")
        labels = getattr(source, "labels", None)
        if labels is not None:
            labels = np.asarray(labels)
            if labels.shape != (count,) or labels.dtype.kind not in "iu":
                raise SourceError(
                    f"--source {spec}: its labels are {labels.dtype} {labels.shape}; expected {count} ints"
                )
        table = KeyTable()
        digest = hashlib.sha256(f"{spec}\0{args_json}\0{count}\n".encode())
        for i in range(count):
            try:
                key = source.key(i)  # type: ignore[attr-defined]
                encoded = key.encode()
            except Exception as exc:
                raise SourceError(
                    f"--source {spec}: key({i}) failed or is not a str: {type(exc).__name__}: {exc}"
                ) from None
            table.add(key, int(labels[i]) if labels is not None else -1, i, 0)
            digest.update(encoded + b"\n")
        fields = getattr(source, "fields", None)
        if fields is None:
            fields = self._fields_of_first(source, spec)
        for name in fields:
            try:
                tg.check_field_name(name)
            except tg.TargetError as exc:
                raise SourceError(f"--source {spec}: {exc}") from None
        class_names = [str(c) for c in getattr(source, "class_names", [])]
        name = spec.rpartition(":")[2]
        super().__init__(
            name, table, class_names, "src-" + digest.hexdigest()[:24], [f for f in fields if f != tg.LABEL]
        )

    @staticmethod
    def _fields_of_first(source: object, spec: str) -> list[str]:
        try:
            _, raw = source.sample(0)  # type: ignore[attr-defined]
            return list(raw)
        except Exception as exc:
            raise SourceError(
                f"--source {spec}: sample(0) failed ({type(exc).__name__}: {exc}); give the object a `fields` "
                f"attribute to name its target fields without reading a sample"
            ) from None

    def locate(self, index: int) -> Location:
        return Location("", index, 0)


def source_sample(source: object, index: int) -> tuple[bytes | np.ndarray, dict[str, np.ndarray]]:
    """Sample ``index`` of a source as (encoded bytes or uint8 RGB array, typed target arrays);
    raises TargetError naming what the source got wrong."""
    try:
        result = source.sample(index)  # type: ignore[attr-defined]
    except Exception as exc:
        raise tg.TargetError(f"the source's sample({index}) raised {type(exc).__name__}: {exc}") from None
    if not isinstance(result, tuple) or len(result) != 2:
        raise tg.TargetError(
            f"the source's sample({index}) returned {type(result).__name__}; expected (image, targets)"
        )
    image, raw = result
    label, arrays = tg.from_source(raw if raw is not None else {})
    if label is not None:
        raise tg.TargetError("a --source gives class labels as its object's `labels`, read once at start-up")
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image), arrays
    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3:
        return np.ascontiguousarray(image), arrays
    shape = getattr(image, "shape", None)
    raise tg.TargetError(
        f"the source's image is {type(image).__name__} {getattr(image, 'dtype', '')} {shape or ''}; expected encoded "
        f"bytes or a uint8 RGB array [H, W, 3]"
    )


def open_source(spec: str, args_json: str) -> SourceShard:
    """The shard of the server's ``--source``; CatalogError when it cannot be used."""
    try:
        return SourceShard(load_source(spec, args_json), spec, args_json)
    except SourceError as exc:
        raise CatalogError(str(exc)) from None
