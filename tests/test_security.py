"""TLS, mutual TLS, bearer tokens, the unauthenticated-bind warning and custom pipelines.

Certificates are made with ``remoteloader.tools.certificates``: a CA, a server certificate for
IP:127.0.0.1 and DNS:localhost, a client certificate, and a second ("rogue") CA with its
own client certificate. Four real servers start at once for the whole module:

    tls     TLS only                      (127.0.0.1)
    mtls    TLS + --tls-client-ca         (127.0.0.1)
    token   --token-file                  (127.0.0.2: loopback, but not 127.0.0.1/localhost)
    open    --allow-custom-pipelines      (127.0.0.2, no authentication)
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import grpc
import pytest
import torch
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remoteloader.client import LoaderError, RemoteLoader, TLSConfig
from remoteloader.protos import codec, loader_pb2
from remoteloader.tools.certificates import (
    CLIENT_AUTH,
    SERVER_AUTH,
    ip_san,
    make_ca,
    make_leaf,
    write_cert,
    write_key,
)
from remoteloader.tools.local import ServerProcess
from remoteloader.tools.textures import make_imagefolder

pytestmark = pytest.mark.timeout(180)

SERVICE = "/remoteloader.v1.Loader/"
SIZE = 32
CLASSES = ["ant", "bee"]
PER_CLASS = 6
N = len(CLASSES) * PER_CLASS
TOKEN = "s3cret-token-0123456789-abcdefXYZ"


# ---- certificates ---------------------------------------------------------------------------
class Certs:
    def __init__(self, d: pathlib.Path):
        d.mkdir(parents=True, exist_ok=True)
        ca_key, ca_cert = make_ca("remoteloader test CA")
        self.ca = write_cert(d / "ca.pem", ca_cert)
        key, cert = make_leaf(ca_key, ca_cert, "loader", SERVER_AUTH,
                             [ip_san("127.0.0.1"), x509.DNSName("localhost")])
        self.server_cert, self.server_key = write_cert(d / "server.pem", cert), write_key(d / "server.key", key)
        key, cert = make_leaf(ca_key, ca_cert, "trainer", CLIENT_AUTH)
        self.client_cert, self.client_key = write_cert(d / "client.pem", cert), write_key(d / "client.key", key)
        rogue_key, rogue_cert = make_ca("rogue CA")
        self.rogue_ca = write_cert(d / "rogue-ca.pem", rogue_cert)
        key, cert = make_leaf(rogue_key, rogue_cert, "intruder", CLIENT_AUTH)
        self.rogue_cert, self.rogue_key = write_cert(d / "rogue.pem", cert), write_key(d / "rogue.key", key)


# ---- the servers ----------------------------------------------------------------------------
class Env:
    def __init__(self, cluster, certs: Certs, data: pathlib.Path, short_token: ServerProcess):
        self.cluster = cluster
        self.certs = certs
        self.data = data
        self.short_token = short_token

    def address(self, i: int) -> str:
        process = self.cluster.servers[i].process
        return f"{process.host}:{process.port}"

    def log(self, i: int) -> str:
        return self.cluster.stderr(i)


TLS, MTLS, TOKEN_SERVER, OPEN = range(4)


@pytest.fixture(scope="module")
def env(module_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("security")
    data = make_imagefolder(base / "data", CLASSES, PER_CLASS, size=(48, 64), seed=11)
    certs = Certs(base / "certs")
    token_file = base / "token"
    token_file.write_text(TOKEN + "\n")  # a trailing newline, as `echo` writes it
    short = base / "short-token"
    short.write_text("tooshort\n")
    c = module_cluster
    c.add(data, "--tls-cert", certs.server_cert, "--tls-key", certs.server_key, wait=False)
    c.add(data, "--tls-cert", certs.server_cert, "--tls-key", certs.server_key,
          "--tls-client-ca", certs.ca, wait=False)
    c.add(data, "--host", "127.0.0.2", "--token-file", str(token_file), wait=False)
    c.add(data, "--host", "127.0.0.2", "--allow-custom-pipelines", wait=False)
    # A token shorter than 16 characters must be refused at start-up (checked by a test below).
    # The wrapper only delays the token check by a second: wherever create_server runs it, a
    # check that fails after the decode workers have started must still end the process (it
    # once printed the error and then hung in multiprocessing's atexit join of a worker that
    # ignores SIGTERM).
    delayed = "\n".join([
        "import sys, time",
        "import remoteloader.server.app as app",
        "check = getattr(app, 'read_token', None)",
        "if check is not None:",
        "    app.read_token = lambda path: (time.sleep(1), check(path))[1]",
        "from remoteloader.server.cli import serve_main",
        "sys.exit(serve_main())",
    ])
    short_token = ServerProcess([sys.executable, "-c", delayed, "--data", str(data), "--port", "0",
                                 "--workers", "1", "--token-file", str(short)])
    try:
        for i in range(4):
            c.wait_ready(i)
        yield Env(c, certs, data, short_token)
    finally:
        short_token.kill()


def _epoch(loader, run_bounded, seconds: float = 60) -> list[int]:
    """One epoch; checks shapes and returns the delivered sample ids."""
    ids = []
    for images, labels, batch_ids in run_bounded(loader, seconds):
        assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (SIZE, SIZE, 3)
        assert len(labels) == len(batch_ids) == len(images)
        assert int(images.float().std()) > 0, "all-constant images: pixels did not arrive"
        ids += batch_ids.tolist()
    return ids


def _loader(address, **kw) -> RemoteLoader:
    kw.setdefault("connect_timeout", 10)
    return RemoteLoader(address, batch_size=5, image_size=SIZE, pipeline="eval", drop_last=False, return_ids=True,
                        **kw)


def _full_epoch(address, run_bounded, **kw) -> None:
    with _loader(address, **kw) as loader:
        ids = _epoch(loader, run_bounded)
    assert sorted(ids) == list(range(N)), f"not every sample exactly once: {sorted(ids)}"


def _ssl_channel(address: str, ca: str | None = None, cert: str | None = None, key: str | None = None):
    read = lambda p: pathlib.Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(read(ca), read(key), read(cert)))


def _raw_stream(channel, requests, metadata=None, timeout: float = 10.0):
    """Runs a Stream call with the given requests; returns (chunks, status code, details)."""
    method = channel.stream_stream(SERVICE + "Stream", request_serializer=loader_pb2.StreamRequest.SerializeToString,
                                   response_deserializer=codec.decode_chunk)
    chunks = []
    try:
        for chunk in method(iter(requests), metadata=metadata, timeout=timeout):
            chunks.append(chunk)
    except grpc.RpcError as exc:
        return chunks, exc.code(), exc.details() or ""
    return chunks, grpc.StatusCode.OK, ""


def _describe(channel, metadata=None, timeout: float = 10.0) -> loader_pb2.DescribeResponse:
    method = channel.unary_unary(SERVICE + "Describe", request_serializer=loader_pb2.DescribeRequest.SerializeToString,
                                 response_deserializer=loader_pb2.DescribeResponse.FromString)
    return method(loader_pb2.DescribeRequest(), metadata=metadata, timeout=timeout)


def _setup_and_order(shard_id: str, setup: loader_pb2.Setup | None = None) -> list[loader_pb2.StreamRequest]:
    setup = setup or loader_pb2.Setup(pipeline="eval", height=SIZE, width=SIZE)
    return [loader_pb2.StreamRequest(setup=setup),
            loader_pb2.StreamRequest(order=loader_pb2.Order(order_id=1, shard_ids=[shard_id], indices=[0, 1, 2]))]


# ---- TLS ------------------------------------------------------------------------------------
def test_full_epoch_over_tls(env, run_bounded):
    _full_epoch(env.address(TLS), run_bounded, tls=env.certs.ca)
    # The certificate's DNS name works too, with the same TLSConfig form.
    port = env.cluster.servers[TLS].port
    _full_epoch(f"localhost:{port}", run_bounded, tls=TLSConfig(env.certs.ca))
    assert "transport: TLS" in env.log(TLS)


def test_full_epoch_over_mutual_tls(env, run_bounded):
    certs = env.certs
    _full_epoch(env.address(MTLS), run_bounded, tls=TLSConfig(certs.ca, certs.client_cert, certs.client_key))
    assert "mutual TLS" in env.log(MTLS)


@pytest.mark.parametrize("who", ["no client certificate", "certificate of another CA"])
def test_mutual_tls_refuses_clients_without_a_valid_certificate(env, who):
    certs = env.certs
    tls = TLSConfig(certs.ca) if who == "no client certificate" else TLSConfig(certs.ca, certs.rogue_cert,
                                                                                 certs.rogue_key)
    started = time.monotonic()
    with pytest.raises((ConnectionError, PermissionError)) as info:
        _loader(env.address(MTLS), tls=tls, connect_timeout=1.5)
    assert time.monotonic() - started < 1.5 + 5, "the refusal took much longer than connect_timeout"
    message = str(info.value)
    assert env.address(MTLS) in message and "TLS" in message, message
    # Raw gRPC: no Describe, no chunk.
    cert, key = (None, None) if who == "no client certificate" else (certs.rogue_cert, certs.rogue_key)
    with _ssl_channel(env.address(MTLS), certs.ca, cert, key) as channel:
        with pytest.raises(grpc.RpcError) as rpc:
            _describe(channel, timeout=3)
        assert rpc.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        chunks, code, _ = _raw_stream(channel, _setup_and_order("any-shard"), timeout=3)
        assert chunks == [] and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_plaintext_client_against_tls_server_fails_within_connect_timeout(env):
    started = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        _loader(env.address(TLS), connect_timeout=1.5)
    elapsed = time.monotonic() - started
    assert elapsed < 1.5 + 3, f"took {elapsed:.1f}s with connect_timeout=1.5"
    assert env.address(TLS) in str(info.value)


def test_client_rejects_a_server_certificate_from_an_unknown_ca(env):
    with pytest.raises(ConnectionError):
        _loader(env.address(TLS), tls=env.certs.rogue_ca, connect_timeout=1.5)


def test_a_ca_file_that_is_not_pem_is_refused_at_once(tmp_path):
    not_pem = tmp_path / "ca.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a not a PEM certificate")
    with pytest.raises(ValueError, match="not a PEM file"):
        TLSConfig(str(not_pem))


def test_tls_client_against_plaintext_server_fails(env):
    with pytest.raises(ConnectionError):
        _loader(env.address(OPEN), tls=env.certs.ca, connect_timeout=1.5)


# ---- bearer token ---------------------------------------------------------------------------
def test_full_epoch_with_the_right_token(env, run_bounded):
    _full_epoch(env.address(TOKEN_SERVER), run_bounded, token=TOKEN)
    assert "authentication: bearer token" in env.log(TOKEN_SERVER)


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcdef", TOKEN + "x", TOKEN[:-1]])
def test_remote_loader_with_a_wrong_or_missing_token_is_refused(env, token):
    with pytest.raises(PermissionError) as info:
        _loader(env.address(TOKEN_SERVER), token=token, connect_timeout=5)
    message = str(info.value)
    assert "UNAUTHENTICATED" in message and env.address(TOKEN_SERVER) in message and "token=" in message, message


BAD_METADATA = {
    "missing": None,
    "wrong": (("authorization", "Bearer not-the-token-0123456789"),),
    "no Bearer prefix": (("authorization", TOKEN),),
    "lowercase scheme": (("authorization", "bearer " + TOKEN),),
    "prefix of the token": (("authorization", "Bearer " + TOKEN[:16]),),
    "token plus a suffix": (("authorization", "Bearer " + TOKEN + "0"),),
    "other header": (("x-token", "Bearer " + TOKEN),),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_every_rpc_refuses_a_wrong_or_missing_token(env, case):
    metadata = BAD_METADATA[case]
    good = (("authorization", "Bearer " + TOKEN),)
    with grpc.insecure_channel(env.address(TOKEN_SERVER)) as channel:
        shard_id = _describe(channel, metadata=good).shards[0].id  # positive control
        with pytest.raises(grpc.RpcError) as info:
            _describe(channel, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        get_keys = channel.unary_unary(SERVICE + "GetKeys",
                                       request_serializer=loader_pb2.GetKeysRequest.SerializeToString,
                                       response_deserializer=loader_pb2.GetKeysResponse.FromString)
        request = loader_pb2.GetKeysRequest(shard_id=shard_id, start=0, count=5)
        assert len(get_keys(request, metadata=good, timeout=10).keys) == 5
        with pytest.raises(grpc.RpcError) as info:
            get_keys(request, metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chunks, code, details = _raw_stream(channel, _setup_and_order(shard_id), metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
        assert chunks == [], "a chunk arrived without the token"
        assert "token" in details
        chunks, code, details = _raw_stream(channel, _setup_and_order(shard_id), metadata=good)
        assert code == grpc.StatusCode.OK and sum(c.header.count for c in chunks) == 3, (code, details)


def test_health_check_needs_no_token(env):
    with grpc.insecure_channel(env.address(TOKEN_SERVER)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "remoteloader.v1.Loader"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_a_token_shorter_than_16_characters_is_refused_at_start(env):
    """The server must exit with an error naming the rule, not serve, and not hang."""
    code = env.short_token.wait(10)
    env.short_token.reap()  # a server still running is killed, with its workers and forkserver
    stderr = env.short_token.stderr()
    if code is None:
        pytest.fail("a server given an 8-character token did not exit within 10s of the other tests "
                    "(e.g. a decode worker that ignores SIGTERM left running, which multiprocessing's atexit "
                    "then joins forever); stderr tail:\n" + stderr[-600:])
    assert code != 0
    assert "listening on" not in stderr
    assert "at least 16" in stderr, stderr[-2000:]


# ---- the unauthenticated-bind warning -------------------------------------------------------
def test_binding_beyond_loopback_without_authentication_warns(env, tmp_path):
    # Tests bind loopback only, so the decision is checked on configurations (nothing is bound)
    # and the log of real loopback servers shows the other branch.
    from remoteloader.server.app import auth_warning
    from remoteloader.server.config import ServerConfig

    token = tmp_path / "token"
    token.write_text("x" * 32)
    for host in ("0.0.0.0", "10.1.2.3", "loader.example", "::"):
        warning = auth_warning(ServerConfig(data=("d",), host=host))
        assert warning and host in warning and "without authentication" in warning
        assert auth_warning(ServerConfig(data=("d",), host=host, token_file=str(token))) is None
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert auth_warning(ServerConfig(data=("d",), host=host)) is None
    assert "without authentication" not in env.log(OPEN)  # 127.0.0.2 is loopback too
    assert "authentication: none (loopback only)" in env.log(OPEN)
    assert "authentication: bearer token" in env.log(TOKEN_SERVER)
    assert "authentication: none (loopback only)" in env.log(TLS)


# ---- custom pipelines -----------------------------------------------------------------------
def _custom_setup(document) -> loader_pb2.Setup:
    text = document if isinstance(document, str) else json.dumps(document)
    return loader_pb2.Setup(pipeline="custom", height=SIZE, width=SIZE, albumentations_json=text)


def _pipeline_dict():
    import albumentations as A

    return A.to_dict(A.Compose([A.Resize(SIZE, SIZE), A.HorizontalFlip(p=0.5)]))


def test_custom_pipelines_are_refused_unless_allowed(env):
    import albumentations as A

    pipeline = A.Compose([A.Resize(SIZE, SIZE)])
    with pytest.raises(ValueError, match="allow-custom-pipelines"):
        RemoteLoader(env.address(TLS), batch_size=4, image_size=SIZE, pipeline=pipeline, tls=env.certs.ca,
                     connect_timeout=10)
    # A client that skips the Describe check is refused by the server itself.
    with _ssl_channel(env.address(TLS), env.certs.ca) as channel:
        shard_id = _describe(channel).shards[0].id
        chunks, code, details = _raw_stream(channel, _setup_and_order(shard_id, _custom_setup(_pipeline_dict())))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and chunks == []
    assert "--allow-custom-pipelines" in details


def test_allowed_custom_pipeline_from_to_dict_works(env, run_bounded):
    with RemoteLoader(env.address(OPEN), batch_size=5, image_size=SIZE, pipeline=_pipeline_dict(), drop_last=False,
                      return_ids=True, connect_timeout=10) as loader:
        ids = _epoch(loader, run_bounded)
    assert sorted(ids) == list(range(N))


def _hostile_documents(marker: pathlib.Path) -> dict:
    import albumentations as A

    command = f"touch {marker}"
    resize = A.to_dict(A.Resize(SIZE, SIZE))["transform"]
    return {
        "os.system": {"__version__": A.__version__,
                      "transform": {"__class_fullname__": "os.system", "command": command}},
        "os.system nested in a Compose": {
            "__version__": A.__version__,
            "transform": {"__class_fullname__": "Compose", "p": 1.0,
                          "transforms": [resize, {"__class_fullname__": "os.system", "command": command}]}},
        "subprocess.Popen": {"__version__": A.__version__,
                             "transform": {"__class_fullname__": "subprocess.Popen", "args": ["touch", str(marker)]}},
        "builtins.eval": {"__version__": A.__version__,
                          "transform": {"__class_fullname__": "builtins.eval",
                                        "source": f"__import__('os').system({command!r})"}},
        "Lambda": {"__version__": A.__version__,
                   "transform": {"__class_fullname__": "Lambda", "name": "x", "p": 1.0}},
        "not JSON": "import os; os.system('touch x')",
        "a JSON list": [1, 2, 3],
    }


def test_custom_pipeline_naming_a_non_albumentations_class_is_refused(env, tmp_path):
    marker = tmp_path / "pwned"
    with grpc.insecure_channel(env.address(OPEN)) as channel:
        shard_id = _describe(channel).shards[0].id
        for name, document in _hostile_documents(marker).items():
            chunks, code, details = _raw_stream(channel, _setup_and_order(shard_id, _custom_setup(document)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
            assert chunks == [], name
        # The server is fine afterwards.
        chunks, code, details = _raw_stream(channel, _setup_and_order(shard_id, _custom_setup(_pipeline_dict())))
        assert code == grpc.StatusCode.OK, details
        assert sum(c.header.count for c in chunks) == 3
    assert not marker.exists(), "a client-sent pipeline ran a command on the server"


def test_oversized_custom_pipeline_json_is_refused(env):
    import albumentations as A

    # A valid pipeline, only too long: the size check, not the parser, must refuse it.
    document = A.to_dict(A.Compose([A.Resize(SIZE, SIZE)] + [A.HorizontalFlip(p=0.5) for _ in range(1500)]))
    text = json.dumps(document)
    assert len(text) > 64 * 1024
    with grpc.insecure_channel(env.address(OPEN)) as channel:
        shard_id = _describe(channel).shards[0].id
        chunks, code, details = _raw_stream(channel, _setup_and_order(shard_id, _custom_setup(text)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and chunks == []
    assert str(64 * 1024) in details, details
    # And through RemoteLoader: a clear error, no data.
    with RemoteLoader(env.address(OPEN), batch_size=4, image_size=SIZE, pipeline=document,
                      connect_timeout=10) as loader:
        with pytest.raises(LoaderError, match="INVALID_ARGUMENT"):
            next(iter(loader))
