"""What installing and importing the package promises: a light client, protos in sync."""

from __future__ import annotations

import importlib.resources
import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SERVER_ONLY = ("cv2", "albumentations", "simplejpeg")

# Runs in a fresh interpreter: server-only packages cannot be imported at all there.
CLIENT_IMPORT = textwrap.dedent("""
    import importlib.abc, json, sys

    BLOCKED = {blocked!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked: the client must not need it")
            return None

    sys.meta_path.insert(0, Block())
    for name in BLOCKED:  # the blocker works, so the test below can fail
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"blocker did not block {{name}}")

    from remoteloader.client import LoaderError, RemoteLoader, SampleFailure

    print(json.dumps(sorted(sys.modules)))
""")


def run_python(code: str, cwd, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_client_imports_without_server_dependencies(tmp_path):
    result = run_python(CLIENT_IMPORT.format(blocked=SERVER_ONLY), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert "remoteloader.client" in modules
    server = [m for m in modules if m == "remoteloader.server" or m.startswith("remoteloader.server.")]
    assert not server, f"importing the client imported {server}"
    assert not [m for m in modules if m.split(".")[0] in SERVER_ONLY]


def test_client_imports_without_transformers_and_the_integration_says_how_to_get_it(tmp_path):
    """transformers is an optional extra, imported by remoteloader.integrations.transformers alone."""
    result = run_python(CLIENT_IMPORT.format(blocked=("transformers",)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert not [m for m in modules if m.split(".")[0] == "transformers" or m.startswith("remoteloader.integrations")]
    integration = CLIENT_IMPORT.format(blocked=("transformers",)).replace(
        "from remoteloader.client import LoaderError, RemoteLoader, SampleFailure",
        "import remoteloader.integrations\nimport remoteloader.integrations.transformers")
    result = run_python(integration, cwd=tmp_path)
    assert result.returncode == 1 and "pip install 'remoteloader[transformers]'" in result.stderr, result.stderr


def test_generated_protos_are_in_sync_with_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    result = subprocess.run([sys.executable, "-m", "remoteloader.protos.generate", "--check"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_generated_module_imports_from_the_package(tmp_path):
    code = textwrap.dedent("""
        import json
        from remoteloader.protos import loader_pb2, loader_pb2_grpc
        print(json.dumps({
            "module": loader_pb2.__name__,
            "package": loader_pb2.DESCRIPTOR.package,
            "file": loader_pb2.DESCRIPTOR.name,
            "services": sorted(loader_pb2.DESCRIPTOR.services_by_name),
            "chunk": loader_pb2.Chunk.DESCRIPTOR.full_name,
            "grpc_uses": loader_pb2_grpc.remoteloader_dot_protos_dot_loader__pb2 is loader_pb2,
        }))
    """)
    result = run_python(code, cwd=tmp_path)  # not the repository root: the installed package
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["module"] == "remoteloader.protos.loader_pb2"
    assert info["package"] == "remoteloader.v1"
    assert info["file"] == "remoteloader/protos/loader.proto"
    assert info["services"] == ["Loader"]
    assert info["chunk"] == "remoteloader.v1.Chunk"
    assert info["grpc_uses"], "loader_pb2_grpc does not import loader_pb2 from remoteloader.protos"


def test_service_methods_match_the_stream_path_clients_use():
    from remoteloader.protos import SERVICE, loader_pb2

    service = loader_pb2.DESCRIPTOR.services_by_name["Loader"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Describe", "GetKeys", "Stream"}
    stream = methods["Stream"]
    assert service.full_name == SERVICE  # the name both sides and the health checks use
    assert f"/{service.full_name}/{stream.name}" == "/remoteloader.v1.Loader/Stream"
    assert stream.client_streaming and stream.server_streaming
    assert stream.input_type.full_name == "remoteloader.v1.StreamRequest"
    assert stream.output_type.full_name == "remoteloader.v1.Chunk"


def test_proto_and_stubs_ship_with_the_package():
    files = importlib.resources.files("remoteloader.protos")
    for name in ("loader.proto", "loader_pb2.pyi", "loader_pb2.py", "loader_pb2_grpc.py"):
        assert files.joinpath(name).is_file(), name
    assert "package remoteloader.v1;" in files.joinpath("loader.proto").read_text()
