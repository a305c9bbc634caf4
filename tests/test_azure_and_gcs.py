"""Loader servers on Azure Blob (``az://``) and GCS (``gs://``) as well tested as on S3: against
real emulators on 127.0.0.1, Azurite (from the npm registry, ``tools/local_azure.py``; skipped
with the reason where npm or the registry is missing) and fake-gcs-server (from its PyPI wheel,
``tools/local_gcs.py``).

Both emulators list an object's ETag bare and return it quoted on a read, as the stores do: the
servers compare them as the HTTP spec means them, so every sample is served (once, over
replicas) and a blob replaced since indexing fails by name.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from remoteloader.client import RemoteLoader
from remoteloader.tools.local import ServerProcess, server_command
from remoteloader.tools.local_azure import LocalAzure
from remoteloader.tools.local_azure import Unavailable as AzureUnavailable
from remoteloader.tools.local_gcs import LocalGCS
from remoteloader.tools.local_gcs import Unavailable as GCSUnavailable
from remoteloader.tools.pack import pack
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SAMPLES = 24


class Store:
    """An emulator with the packed shards under ``packed/`` of its bucket ``data``."""

    def __init__(self, scheme: str, emulator, local: pathlib.Path):
        self.scheme, self.emulator, self.local = scheme, emulator, local

    def url(self, name: str) -> str:
        return f"{self.scheme}://data/{name}"

    def env(self) -> dict[str, str]:
        return self.emulator.env()

    def put(self, name: str, data: bytes) -> None:
        if self.scheme == "gs":  # (fake-gcs-server takes uploads through its JSON API only)
            self.emulator.put("data", name, data)
            return
        import obstore
        from obstore.store import from_url

        env = self.env()
        account = env["AZURE_STORAGE_ACCOUNT_NAME"]
        store = from_url("az://data", account_name=account, account_key=env["AZURE_STORAGE_ACCOUNT_KEY"],
                         endpoint=f"{self.emulator.endpoint}/{account}", client_options={"allow_http": "true"})
        obstore.put(store, name, data)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("stores")
    folder = make_imagefolder(root / "folder", ["ant", "bee", "cat"], SAMPLES // 3, size=(96, 128), seed=3)
    pack(str(folder), str(root / "packed"), shard_size=60_000, progress=False)
    return root / "packed"


@pytest.fixture(scope="module", params=["az", "gs"])
def store(request, packed, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    try:
        emulator = (LocalAzure(folder) if request.param == "az" else LocalGCS(folder)).start()
    except (AzureUnavailable, GCSUnavailable) as exc:
        pytest.skip(str(exc))
    s = Store(request.param, emulator, packed)
    for file in sorted(packed.rglob("*")):
        if file.is_file():
            s.put(f"packed/{file.relative_to(packed).as_posix()}", file.read_bytes())
    yield s
    emulator.stop()


def loader(addresses, **kwargs) -> RemoteLoader:
    options = dict(batch_size=5, image_size=48, drop_last=False, return_ids=True, seed=7, connect_timeout=30)
    options.update(kwargs)
    return RemoteLoader(addresses, **options)


def epoch(L, run_bounded) -> dict[int, tuple]:
    """Each sample's label and pixels by id; a sample served twice fails the test."""
    out: dict[int, tuple] = {}
    for images, labels, ids in run_bounded(L, 120):
        for image, label, i in zip(images.numpy(), labels.numpy(), ids.numpy()):
            assert int(i) not in out, f"sample {int(i)} served twice"
            out[int(i)] = (int(label), image.copy())
    return out


def test_replicas_on_the_store_serve_every_sample_once_with_the_pixels_of_the_disk(cluster, store, run_bounded,
                                                                                 tmp_path):
    replicas = [cluster.add([store.url("packed")], "--cache-dir", str(tmp_path / f"c{k}"), env=store.env())
                for k in range(2)]
    disk = cluster.add([str(store.local)], "--cache-dir", str(tmp_path / "disk"))
    with loader(cluster.address(disk)) as L:
        expected = epoch(L, run_bounded)
    with loader([cluster.address(i) for i in replicas]) as L:
        shards = L.sample_space.shards
        assert len(shards) > 1 and all(len(s.owners) == 2 for s in shards), "two servers on a bucket: replicas"
        got = epoch(L, run_bounded)
    assert sorted(got) == list(range(SAMPLES)), "a sample was lost (ETags compared as strings?)"
    for i, (label, image) in expected.items():
        assert got[i][0] == label and (got[i][1] == image).all(), f"sample {i} differs from the disk's"


def test_a_blob_replaced_since_indexing_fails_its_samples_by_name(cluster, store, run_bounded, tmp_path):
    for file in sorted(store.local.rglob("*")):  # a copy this test may spoil
        store.put(f"spoiled/{file.relative_to(store.local).as_posix()}", file.read_bytes())
    i = cluster.add([store.url("spoiled")], "--cache-dir", str(tmp_path / "c"), env=store.env())
    tar = sorted(p.name for p in store.local.glob("*.tar"))[0]
    store.put(f"spoiled/{tar}", (store.local / tar).read_bytes() + b"\0" * 512)  # same samples, another version
    failures = []
    with loader(cluster.address(i), on_error=failures.extend) as L:
        ids = [int(v) for _x, _y, batch in run_bounded(L, 120) for v in batch]
    assert sorted(ids) == list(range(SAMPLES)), "a batch lost or repeated samples around the failures"
    reasons = [f.reason for f in failures]
    assert reasons and all("changed since the server indexed it" in r and store.url(f"spoiled/{tar}") in r
                           for r in reasons), reasons
    assert len(reasons) < SAMPLES, "samples of the shards left alone failed too"


def start_failure(url: str, env: dict[str, str], tmp_path) -> str:
    """What a server on ``url`` says as it stops at start (it must stop, without a traceback)."""
    process = ServerProcess([*server_command(), "--data", url, "--port", "0", "--cache-dir", str(tmp_path),
                             "--store-timeout", "2"], env=env)
    code = process.wait(60)
    output = process.stderr()
    process.kill()
    assert code not in (None, 0), output
    assert url in output and "Traceback" not in output, output
    return output


def test_a_missing_container_or_bucket_stops_the_server_naming_it_and_the_fix(store, tmp_path):
    output = start_failure(f"{store.scheme}://no-such-bucket/packed", store.env(), tmp_path)
    word = "container" if store.scheme == "az" else "bucket"
    assert f"no such {word}" in output and f"create the {word}" in output, output
    assert "<?xml" not in output, output


def test_refused_credentials_or_a_plain_http_endpoint_name_the_fix_for_the_store(store, tmp_path):
    env = store.env()
    if store.scheme == "az":
        env["AZURE_STORAGE_ACCOUNT_KEY"] = "d3Jvbmc="  # another key than the account's
        output = start_failure(store.url("packed"), env, tmp_path)
        assert "refused these credentials" in output and "AZURE_STORAGE_ACCOUNT_KEY" in output, output
    else:
        del env["GOOGLE_ALLOW_HTTP"]
        output = start_failure(store.url("packed"), env, tmp_path)
        assert "plain HTTP" in output and "GOOGLE_ALLOW_HTTP=true" in output, output
    assert "AWS_" not in output, output


def test_etags_compare_as_http_means_them_and_no_azure_account_names_azures_variables(monkeypatch):
    from remoteloader.server.storage import ObjectStorage, StorageError, bare_etag

    assert bare_etag('"0x1DD17261FCAB0F0"') == bare_etag("0x1DD17261FCAB0F0") == "0x1DD17261FCAB0F0"
    assert bare_etag('W/"abc"') == "abc" and bare_etag(None) == "" and bare_etag('"') == '"'
    for key in list(os.environ):
        if key.startswith(("AZURE_", "AZURITE_", "AWS_", "GOOGLE_")):
            monkeypatch.delenv(key)
    with pytest.raises(StorageError) as raised:  # (refused before any request: no account to ask for)
        ObjectStorage("az://data", retry_seconds=1).walk()
    text = str(raised.value)
    assert text.startswith("az://data") and "no credentials for the Azure store" in text, text
    assert "AZURE_STORAGE_ACCOUNT_NAME" in text and "AWS_" not in text, text
