"""The deployment files: docker-compose.yml, deploy/Dockerfile, deploy/k8s, and .ci/run.

Nothing here needs Docker or Kubernetes: the files are parsed and cross-checked, and the
exact server command compose runs for loader-0 (the image's ENTRYPOINT + compose's
``command`` with compose's environment) is run locally, with only the container path
``/data``, the port and REMOTELOADER_HOST replaced.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ANY_PORT

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

from remoteloader.server import config as config_module
from remoteloader.tools.local import ServerProcess, ServerStartError
from remoteloader.tools.textures import make_imagefolder

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
POD_OWNERS = ("StatefulSet", "Deployment", "DaemonSet", "Job")
CONTAINER_PORT = 50051
HEALTH_PORT = 50052  # the image's plaintext health port (REMOTELOADER_HEALTH_PORT)


# ---- parsing helpers ------------------------------------------------------------------------
def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _pyproject() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        return tomllib.loads(text)
    pytest.importorskip("tomli")
    import tomli

    return tomli.loads(text)


class Stage:
    def __init__(self, name: str, base: str):
        self.name = name
        self.base = base
        self.instructions: list[tuple[str, str]] = []

    def last(self, keyword: str) -> str | None:
        values = [v for k, v in self.instructions if k == keyword]
        return values[-1] if values else None

    def all(self, keyword: str) -> list[str]:
        return [v for k, v in self.instructions if k == keyword]


def _dockerfile() -> dict[str, Stage]:
    """Stages by name, each with its instructions (continuation lines joined, comments dropped)."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    stages: dict[str, Stage] = {}
    stage = None
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.IGNORECASE)
            assert match, f"cannot parse {line!r}"
            stage = Stage(match.group(2) or f"stage{len(stages)}", match.group(1))
            stages[stage.name] = stage
        else:
            assert stage is not None, f"{line!r} before any FROM"
            stage.instructions.append((keyword, rest.strip()))
    return stages


def _exec_form(value: str) -> list[str]:
    """["a", "b"] (JSON exec form) or a shell-form string, as argv."""
    value = value.strip()
    if value.startswith("["):
        return yaml.safe_load(value)
    return shlex.split(value)


def _inherited(stages: dict[str, Stage], name: str, keyword: str):
    """The value of ENTRYPOINT/USER/... for a stage, following FROM <stage> inheritance."""
    stage = stages[name]
    while True:
        value = stage.last(keyword)
        if value is not None:
            return value
        if stage.base not in stages:
            return None
        stage = stages[stage.base]


def _env(stages: dict[str, Stage], name: str) -> dict[str, str]:
    chain = []
    stage = stages[name]
    while True:
        chain.append(stage)
        if stage.base not in stages:
            break
        stage = stages[stage.base]
    env = {}
    for stage in reversed(chain):
        for value in stage.all("ENV"):
            for item in shlex.split(value):
                key, sep, val = item.partition("=")
                assert sep, f"ENV {value!r}: expected KEY=VALUE pairs"
                env[key] = val
    return env


def _healthcheck(stage: Stage) -> list[str]:
    value = stage.last("HEALTHCHECK")
    assert value, "the server stage has no HEALTHCHECK"
    _, sep, command = value.partition("CMD ")
    assert sep, value
    return _exec_form(command)


def _scripts() -> dict[str, str]:
    return _pyproject()["project"]["scripts"]


def _script_path(name: str) -> str:
    path = pathlib.Path(sys.executable).with_name(name)
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.skip(f"console script {name} is not installed next to {sys.executable} nor on PATH")
    return found


def _server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remoteloader-server", exit_on_error=False)
    config_module.add_arguments(parser)
    return parser


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _parse(parser: argparse.ArgumentParser, argv: list[str], env: dict[str, str] | None = None):
    """parse_args with only ``env`` as REMOTELOADER_* variables (defaults read the environment)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(config_module.ENV_PREFIX)}
    try:
        for k in saved:
            del os.environ[k]
        os.environ.update({k: v for k, v in (env or {}).items() if k.startswith(config_module.ENV_PREFIX)})
        fresh = argparse.ArgumentParser(prog=parser.prog, exit_on_error=False)
        config_module.add_arguments(fresh)
        unknown = [a for a in argv if a.startswith("--") and a.split("=")[0] not in _option_strings(fresh)]
        assert not unknown, f"flags the server does not have: {unknown}"
        try:
            return fresh.parse_args(argv)
        except (argparse.ArgumentError, SystemExit) as exc:
            pytest.fail(f"the server's argument parser refuses {argv}: {exc}")
    finally:
        for k in [k for k in os.environ if k.startswith(config_module.ENV_PREFIX)]:
            del os.environ[k]
        os.environ.update(saved)


def _volume_name(spec) -> str | None:
    """The named volume of a compose volume entry ("name:/path[:ro]" or the long form), else None."""
    if isinstance(spec, dict):
        return spec.get("source") if spec.get("type", "volume") == "volume" else None
    source = str(spec).split(":")[0]
    if source.startswith((".", "/", "~", "$")) or ":" not in str(spec):
        return None
    return source


# ---- docker compose -------------------------------------------------------------------------
def test_compose_parses_and_builds_existing_targets():
    compose = _compose()
    stages = _dockerfile()
    services = compose["services"]
    assert services, "no services"
    for name, service in services.items():
        build = service.get("build")
        if build is None:
            continue
        build = {"context": build} if isinstance(build, str) else build
        context = ROOT / build.get("context", ".")
        assert context.is_dir(), f"{name}: build context {context} does not exist"
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.resolve() == DOCKERFILE.resolve(), f"{name}: builds {dockerfile}"
        target = build.get("target")
        assert target in stages, f"{name}: build target {target!r} is not a stage of {DOCKERFILE} ({list(stages)})"


def test_compose_volumes_are_declared():
    compose = _compose()
    declared = set((compose.get("volumes") or {}).keys())
    used = set()
    for name, service in compose["services"].items():
        for spec in service.get("volumes", []):
            volume = _volume_name(spec)
            if volume is not None:
                assert volume in declared, f"{name}: volume {volume!r} is not declared under volumes:"
                used.add(volume)
    assert used, "no service mounts a named volume"
    assert declared <= used, f"declared but unused volumes: {declared - used}"


def _mounts(service: dict) -> dict[str, str]:
    """container path -> volume name."""
    out = {}
    for spec in service.get("volumes", []):
        parts = str(spec).split(":")
        if len(parts) >= 2:
            out[parts[1]] = parts[0]
    return out


def _flag(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def test_compose_per_shard_loaders_and_shared_profile():
    services = _compose()["services"]
    stages = _dockerfile()
    # Server-local shards: loader-0, loader-1, each with its own volume, filled by "prepare".
    loaders = sorted(n for n in services if re.fullmatch(r"loader-\d+", n))
    assert loaders == ["loader-0", "loader-1"], loaders
    prepare = services["prepare"]
    prepared = _mounts(prepare)
    prepare_root = _flag(prepare["command"], "--prepare")
    assert int(_flag(prepare["command"], "--servers")) == len(loaders)
    volumes = set()
    for n in loaders:
        service = services[n]
        assert service.get("profiles") == ["local"], f"{n}: the server-local set-up is profile local"
        assert service["build"]["target"] == "server"
        data = _flag(service["command"], "--data")
        volume = _mounts(service).get(data)
        assert volume, f"{n}: --data {data} is not a mounted volume"
        volumes.add(volume)
        # prepare writes shard-N into that same volume
        assert prepared.get(f"{prepare_root}/shard-{n.split('-')[1]}") == volume, (n, prepared, volume)
        assert service["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
        assert service.get("shm_size"), f"{n}: decoded chunks live in /dev/shm; set shm_size"
    assert len(volumes) == len(loaders), "each per-shard loader must mount its own shard volume"
    # Profile "shared": one dataset volume for every replica of "loader".
    shared = {n for n, s in services.items() if "shared" in (s.get("profiles") or [])}
    assert {"loader", "trainer-shared", "prepare-shared"} <= shared, shared
    loader = services["loader"]
    assert loader["build"]["target"] == "server"
    assert "container_name" not in loader, "a fixed container_name prevents --scale"
    assert not any(":" in str(p) for p in loader.get("ports", [])), "host port mappings prevent --scale"
    data = _flag(loader["command"], "--data")
    assert _mounts(loader)[data] == _mounts(services["prepare-shared"])[_flag(
        services["prepare-shared"]["command"], "--prepare") + "/shard-0"]
    # Trainers use the trainer stage, whose entrypoint is the remoteloader command; the data is
    # prepared on the server image, which has no torch (test_prepare_imports_no_torch...).
    for n in ("trainer", "trainer-shared"):
        assert services[n]["build"]["target"] == "trainer"
    for n in ("prepare", "prepare-shared"):
        assert services[n]["build"]["target"] == "server" and services[n]["entrypoint"] == ["remoteloader"]
    assert _exec_form(_inherited(stages, "trainer", "ENTRYPOINT")) == ["remoteloader"]


def test_every_compose_service_is_in_a_profile_so_no_command_starts_a_stack_by_mistake():
    """Without a default stack, `up --scale loader=3` missing `--profile shared` starts nothing
    (compose v1 ignored the --scale and started the server-local stack and its demo)."""
    services = _compose()["services"]
    unprofiled = [n for n, s in services.items() if not s.get("profiles")]
    assert not unprofiled, f"{unprofiled} would start on a plain `docker compose up`"
    for scaled, profile in (("loader", "shared"), ("loader-s3", "s3")):
        assert services[scaled]["profiles"] == [profile]
    guide = (ROOT / "docs" / "deploy.md").read_text()
    for profile in sorted({p for s in services.values() for p in s["profiles"]}):
        assert f"docker compose --profile {profile} up" in guide, profile
    assert "docker-compose --profile" in guide, "compose v1's spelling"


def test_compose_trainers_connect_to_servers_that_exist():
    from remoteloader.tools import demo as demo_module

    services = _compose()["services"]
    parser = argparse.ArgumentParser(prog="remoteloader demo", exit_on_error=False)
    demo_module.add_arguments(parser)
    for name in ("trainer", "trainer-shared"):
        service = services[name]
        command = service["command"]
        assert command[0] == "demo"
        parser.parse_args(command[1:])  # the demo accepts these flags
        connect = _flag(command, "--connect")
        assert connect, f"{name}: no --connect"
        profiles = set(service.get("profiles") or [])
        for target in connect.split(","):
            host, _, port = target.rpartition(":")
            assert host in services, f"{name} connects to {host!r}, which is not a service"
            server = services[host]
            assert server["build"]["target"] == "server", f"{name} connects to {host}, not a loader"
            assert set(server.get("profiles") or []) <= profiles, f"{host} does not run with {name}'s profiles"
            listen = int(_flag(server["command"], "--port"))
            assert int(port) == listen, f"{name} connects to {host}:{port}, which listens on {listen}"
            assert str(listen) in [str(p) for p in server.get("expose", [])], f"{host} does not expose {listen}"
            assert server.get("environment", {}).get("REMOTELOADER_HOST") == "0.0.0.0", \
                f"{host} must bind all interfaces inside its container"
            assert service["depends_on"][host]["condition"] == "service_healthy"
    for name in ("prepare", "prepare-shared"):
        parser.parse_args(services[name]["command"][1:])


def test_a_killed_loader_comes_back_and_one_shots_do_not_loop():
    """Docker restarts ``always`` whatever ended the container but `stop`/`down`; ``unless-stopped``
    takes `docker kill` for a manual stop and leaves the loader down (issue 43)."""
    services = _compose()["services"]
    for name, service in services.items():
        if service.get("build", {}).get("target") == "server" and "command" in service and "entrypoint" not in service:
            assert service.get("restart") == "always", f"{name}: restart {service.get('restart')!r}"
        elif name.startswith(("prepare", "trainer")):
            # A one-shot that ends 0 must stay ended; prepare-s3 retries until the store answers.
            assert service.get("restart") in (None, "no", "on-failure"), name
    loaders = [n for n, s in services.items() if s.get("restart") == "always"]
    assert sorted(loaders) == ["loader", "loader-0", "loader-1", "loader-s3"], loaders
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert "restart: always" in guide and "restart: always" in COMPOSE.read_text()


NUMBERS = {"three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}


def test_the_compose_guide_says_what_each_compose_runs_and_returns():
    """docs/deploy.md's table for compose v1 and v2, against the file: the volumes v1 creates
    without a profile, the services each command names, and the stop command of each profile."""
    compose = _compose()
    services = compose["services"]
    guide = (ROOT / "docs" / "deploy.md").read_text()
    header = COMPOSE.read_text().split("\nx-", 1)[0]
    created = re.search(r"creates the (\w+) volumes", guide)
    assert created and NUMBERS[created.group(1)] == len(compose["volumes"]), "v1's volumes without a profile"
    assert "creates the " + created.group(1) + " volumes" in header
    for text in (guide, header):
        assert "no service selected" in text and "returns by itself when the demo ends" in text
        assert re.search(r"leaves? the loaders running|the loaders left running", text)
    for profile in sorted({p for s in services.values() for p in s["profiles"]}):
        assert f"docker compose --profile {profile} up" in guide, profile
        assert f"--profile {profile} down" in guide or profile in re.search(r"--profile \w+ down` \(or ([^)]*)\)",
                                                                            guide).group(1), profile
    for row in re.findall(r"^\| `(--profile \w+ up [^`]*)` \| ([^|]*) \|", guide, re.M):
        command, runs = row
        profile = command.split()[1]
        named = set(re.findall(r"`([\w-]+)`", runs))
        in_profile = {n for n, s in services.items() if profile in s["profiles"]}
        assert named <= in_profile, f"{command}: the guide names {named - in_profile}, not in profile {profile}"
        words, positional = command.split()[3:], []
        while words:
            word = words.pop(0)
            if word in ("--scale", "--exit-code-from"):
                words.pop(0)
            elif not word.startswith("-"):
                positional.append(word)
        # up SERVICE: it and what it depends on, recursively; up alone: every service of the profile.
        wanted, todo = set(), list(positional)
        while todo:
            name = todo.pop()
            wanted.add(name)
            todo.extend(d for d in services[name].get("depends_on", {}) if d not in wanted)
        if named or positional:
            assert named == (wanted or in_profile), (command, named, wanted or in_profile)
        else:
            assert runs.strip() in ("the same", "as `shared`"), (command, runs)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="compose v1 (docker-compose) is not installed")
def test_compose_v1_reads_the_file_as_these_tests_do():
    """docker-compose 1.29 (no engine needed for `config`): every profile's services, the merged
    anchors (restart policies, the prepare services' image and entrypoint) as the tests read them."""
    services = _compose()["services"]
    for profile in sorted({p for s in services.values() for p in s["profiles"]}):
        done = subprocess.run(["docker-compose", "-f", str(COMPOSE), "--profile", profile, "config"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        resolved = yaml.safe_load(done.stdout)["services"]
        for name, service in resolved.items():
            mine = services[name]
            for key in ("restart", "entrypoint", "image", "user", "init"):
                assert service.get(key) == mine.get(key), (profile, name, key, service.get(key), mine.get(key))
            assert service.get("build", {}).get("target") == mine.get("build", {}).get("target"), (profile, name)


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides; ``!`` re-includes."""
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.strip("/")
        regex = "".join(".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]" if tok == "?" else re.escape(tok)
                        for tok in re.findall(r"\*\*|\*|\?|[^*?]+", body))
        regex = regex.replace(".*/", "(?:.*/)?")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_the_build_context_holds_what_the_image_copies_and_not_the_history():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert _dockerignored(".git", patterns) and _dockerignored(".git/objects/pack/x.pack", patterns)
    for heavy in ("tests/fixtures/a.jpg", "benchmarks/scale.py", "docs/deploy.md", "server/__pycache__/a.pyc",
                  "server/_jpeg.cpython-311-x86_64-linux-gnu.so", "remoteloader.egg-info/PKG-INFO"):
        assert _dockerignored(heavy, patterns), heavy
    sources = set()
    for stage in _dockerfile().values():
        for value in stage.all("COPY"):
            args = [a for a in shlex.split(value) if not a.startswith("--")]
            sources.update(args[:-1])
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.split()
    if not tracked:  # not a git checkout: the files on disk
        tracked = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()]
    copied = [f for f in tracked if any(f == s or f.startswith(s.rstrip("/") + "/") for s in sources)]
    assert len(copied) > 20, copied
    left_out = [f for f in copied if _dockerignored(f, patterns)]
    assert not left_out, f".dockerignore keeps files the image copies out of the context: {left_out}"


def _run_for_modules(argv: list[str], tmp_path: pathlib.Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Runs ``remoteloader ARGV`` (its console script's function, in a fresh interpreter) and returns
    the process and every module it had imported when the command returned. (``-X importtime``
    does not see modules imported through importlib, as the CLI imports its subcommands.)"""
    modules = tmp_path / "modules.json"
    code = (
        "import json, sys\n"
        "from remoteloader.tools.cli import main\n"
        f"code = main({argv!r})\n"
        f"open({str(modules)!r}, 'w').write(json.dumps(sorted(sys.modules)))\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, set(json.loads(modules.read_text()))


def test_prepare_imports_no_torch_and_runs_on_the_server_image(tmp_path):
    """Compose's prepare services, and the pack that prepare-s3 runs, make the demo's data on the
    server image: no torch there, and none imported (a CPU host builds no trainer to prepare)."""
    services = _compose()["services"]
    stages = _dockerfile()
    for name in ("prepare", "prepare-shared", "prepare-s3"):
        service = services[name]
        assert service["build"]["target"] == "server" and service["image"] == services["loader"]["image"], name
        assert service["user"] == "root", f"{name} fills new volumes, which are root's"
        assert service["healthcheck"] == {"disable": True}, f"{name} would inherit the server's health check"
        assert "torch" not in json.dumps(service), name
    assert "torch" not in " ".join(stages["server"].all("RUN"))
    for name in ("prepare", "prepare-shared"):
        entrypoint, argv = services[name]["entrypoint"], list(services[name]["command"])
        assert entrypoint == ["remoteloader"] and _scripts()["remoteloader"] == "remoteloader.tools.cli:main"
        root = tmp_path / name
        argv[argv.index(_flag(argv, "--prepare"))] = str(root)
        _, imported = _run_for_modules([*argv, "--images-per-class", "4"], tmp_path)  # a small dataset
        assert {"remoteloader.tools.demo", "cv2"} <= imported
        assert not {m for m in imported if m.split(".")[0] == "torch"}, f"{name} imports torch"
        servers = int(_flag(argv, "--servers"))
        assert sorted(p.name for p in root.iterdir()) == [f"shard-{i}" for i in range(servers)]
        assert len(list(root.glob("shard-0/*/*.jpg"))) == 4 // servers * 4  # per shard, x the default 4 classes
    # prepare-s3's pack, into a folder (its bucket is tested against a real store below).
    assert "remoteloader pack " in services["prepare-s3"]["command"][0]
    argv = ["pack", str(tmp_path / "prepare" / "shard-0"), str(tmp_path / "packed"), "--quiet"]
    _, imported = _run_for_modules(argv, tmp_path)
    assert "remoteloader.tools.pack" in imported
    assert not {m for m in imported if m.split(".")[0] == "torch"}, "pack imports torch"
    assert list((tmp_path / "packed").glob("*.tar"))


def test_the_trainer_image_takes_the_cpu_build_of_torch_unless_asked():
    """A CPU host's first `up --build` must not download several GB of CUDA wheels."""
    cpu = "https://download.pytorch.org/whl/cpu"
    trainer = _dockerfile()["trainer"]
    arguments = dict(value.split("=", 1) for value in trainer.all("ARG"))
    assert arguments["TORCH_INDEX_URL"].strip('"') == cpu, arguments
    for name, service in _compose()["services"].items():
        if service.get("build", {}).get("target") == "trainer":
            assert service["build"]["args"]["TORCH_INDEX_URL"] == f"${{TORCH_INDEX_URL:-{cpu}}}", name
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert "TORCH_INDEX_URL=https://pypi.org/simple docker compose" in guide, "the guide says how to ask for CUDA"


# ---- Dockerfile -----------------------------------------------------------------------------
def test_dockerfile_entrypoints_are_console_scripts_and_copies_exist():
    stages = _dockerfile()
    assert "server" in stages and "trainer" in stages
    scripts = _scripts()
    entry = _exec_form(_inherited(stages, "server", "ENTRYPOINT"))
    assert entry == ["remoteloader-server"], entry
    assert entry[0] in scripts, f"ENTRYPOINT {entry[0]} is not in [project.scripts] {list(scripts)}"
    assert scripts["remoteloader-server"] == "remoteloader.server.cli:serve_main"
    assert _exec_form(_inherited(stages, "trainer", "ENTRYPOINT"))[0] in scripts
    assert _healthcheck(stages["server"])[0] in scripts
    copied = set()
    for stage in stages.values():
        for value in stage.all("COPY"):
            args = [a for a in shlex.split(value) if not a.startswith("--")]
            assert len(args) >= 2, value
            for source in args[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the build context"
                copied.add(pathlib.PurePosixPath(source).as_posix().rstrip("/"))
    # Every package directory of pyproject (and the files pip needs) is copied into the image.
    package_dirs = _pyproject()["tool"]["setuptools"]["package-dir"].values()
    for needed in list(package_dirs) + ["pyproject.toml", "setup.py", "README.md"]:
        parents = [p.as_posix() for p in pathlib.PurePosixPath(needed).parents]
        assert needed in copied or copied & set(parents), f"{needed} is not copied into the image"
    dockerignore = ROOT / ".dockerignore"
    if dockerignore.exists():
        ignored = [line.strip() for line in dockerignore.read_text().splitlines() if line.strip()]
        for source in copied:
            assert source not in ignored, f"{source} is COPY'd but excluded by .dockerignore"


def test_dockerfile_expose_matches_compose_and_healthcheck():
    stages = _dockerfile()
    server = stages["server"]
    exposed = {int(p.split("/")[0]) for value in server.all("EXPOSE") for p in value.split()}
    assert exposed == {CONTAINER_PORT, HEALTH_PORT}, exposed
    env = _env(stages, "server")
    assert int(env["REMOTELOADER_PORT"]) == CONTAINER_PORT
    assert int(env["REMOTELOADER_HEALTH_PORT"]) == HEALTH_PORT
    health = _healthcheck(server)
    # No address: the probe reads the REMOTELOADER_* variables, so --port, TLS and tokens do not matter.
    assert health[1:] == ["probe"], health
    for name, service in _compose()["services"].items():
        if service.get("build", {}).get("target") != "server" or "entrypoint" in service:
            continue  # not a loader (the prepare services are one-shots on the server image)
        assert int(_flag(service["command"], "--port")) in exposed, name
        assert {int(p) for p in service.get("expose", [])} <= exposed, name
        assert service.get("stop_grace_period"), f"{name}: give the drain time (stop_grace_period)"
    assert server.last("STOPSIGNAL") in (None, "SIGTERM")


def test_the_trainer_has_no_server_healthcheck_and_takes_its_torch_build_from_compose():
    stages = _dockerfile()
    trainer = stages["trainer"]
    assert trainer.last("HEALTHCHECK") == "NONE", "the trainer would inherit the server's health check"
    arguments = {value.split("=", 1)[0] for value in trainer.all("ARG")}
    assert {"TORCH", "TORCH_INDEX_URL"} <= arguments, arguments
    install = " ".join(trainer.all("RUN"))
    assert "${TORCH}" in install and "TORCH_INDEX_URL" in install, install
    for name, service in _compose()["services"].items():
        build = service.get("build", {})
        assert service.get("init") is True, f"{name}: no init as PID 1 (docker stop's SIGTERM, zombies)"
        if build.get("target") == "trainer":
            assert set(build.get("args", {})) <= arguments, f"{name}: build args the Dockerfile does not take"
            assert "TORCH" in build["args"], f"{name}: the torch build cannot be chosen through compose"


# ---- the image's versions: pyproject.toml's ranges, deploy/constraints.txt's pins -------------------
CONSTRAINTS = ROOT / "deploy" / "constraints.txt"


def _constraints_module():
    spec = importlib.util.spec_from_file_location("constraints", ROOT / "deploy" / "constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _server_requirements():
    """pyproject's requirements that the server image installs: the core ones and the server extra's."""
    from packaging.requirements import Requirement

    project = _pyproject()["project"]
    return [Requirement(text) for text in project["dependencies"] + project["optional-dependencies"]["server"]]


def test_every_server_dependency_is_bounded_and_pinned_inside_its_range():
    from packaging.markers import default_environment
    from packaging.utils import canonicalize_name

    pins = _constraints_module().read(CONSTRAINTS)
    environment = {**default_environment(), "python_version": "3.11", "sys_platform": "linux"}  # the image's
    for requirement in _server_requirements():
        # An upper bound, so that the next major version of a dependency is a decision, not a surprise.
        assert any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier), \
            f"{requirement}: no upper bound"
        if requirement.marker is not None and not requirement.marker.evaluate({**environment, "extra": "server"}):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not pinned in {CONSTRAINTS.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            f"{CONSTRAINTS.name} pins {name}=={pins[name]}, outside pyproject's {requirement}"
    # The image installs with these pins, and copies the file before it does.
    server = _dockerfile()["server"]
    install = " ".join(server.all("RUN"))
    assert re.search(r'pip install "\.\[server\]" -c deploy/constraints\.txt', install), install
    assert any("deploy/constraints.txt" in value for value in server.all("COPY"))


def test_the_video_server_image_pins_pyav_inside_the_video_extra():
    from packaging.requirements import Requirement

    (extra,) = [Requirement(text) for text in _pyproject()["project"]["optional-dependencies"]["video"]]
    video = _dockerfile()["server-video"]
    (pin,) = re.findall(r'pip install "av==([^"]+)"', " ".join(video.all("RUN")))
    assert extra.name == "av" and extra.specifier.contains(pin), (str(extra), pin)


def test_the_constraints_pin_every_requirement_of_what_they_pin():
    """The pins are a closed set: each pinned distribution installed here at its pinned version has
    each of its own requirements pinned, inside that requirement's range (a pin missing here would
    leave pip free to take the newest version of it)."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = _constraints_module().read(CONSTRAINTS)
    checked = 0
    for name, version in pins.items():
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if distribution.version != version:
            continue  # another version here: its requirements may differ from the pinned one's
        checked += 1
        for text in distribution.requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is not None and not marker.evaluate({**default_environment(), "extra": ""}):
                continue
            needed = canonicalize_name(requirement.name)
            assert needed in pins, f"{name}=={version} requires {requirement}, which {CONSTRAINTS.name} does not pin"
            assert requirement.specifier.contains(pins[needed], prereleases=True), (name, str(requirement))
    assert checked, f"none of {CONSTRAINTS.name}'s pins is installed here: run the tests where the image's versions are"


# ---- the image's size: deploy/prune_site_packages.py --------------------------------------------
PRUNE = ROOT / "deploy" / "prune_site_packages.py"


def _image_size_module():
    spec = importlib.util.spec_from_file_location("image_size", ROOT / "deploy" / "image_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_size_section_is_the_last_measurement_rendered():
    """docs/deploy.md's figures come from deploy/image_size.json through deploy/image_size.py,
    never by hand; the measurement is of the pinned versions and within the 470 MB budget."""
    sizes = _image_size_module()
    figures = json.loads((ROOT / "deploy" / "image_size.json").read_text())
    guide = (ROOT / "docs" / "deploy.md").read_text()
    start, end = guide.index(sizes.BEGIN), guide.index(sizes.END) + len(sizes.END) + 1
    assert guide[start:end] == sizes.render(figures), "rewrite it: python deploy/image_size.py render (or measure)"
    assert guide.index("## Image size") < start < guide.index("## docker compose")
    assert figures["image_bytes"] <= 470 * sizes.MB, figures["image_bytes"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", figures["date"]) and figures["engine"]
    measured = set(figures["site_packages"]) - {"pip", "setuptools", "wheel", "remoteloader", "(unrecorded)"}
    assert measured == set(_constraints_module().read(CONSTRAINTS)), "the figures are not of the pinned set"
    rows = dict(sizes.groups(figures["site_packages"]))
    assert sum(rows.values()) == sum(figures["site_packages"].values())
    for label, value in rows.items():  # each row's last column: what that part weighs in the image
        (line,) = [line for line in guide.splitlines() if line.startswith(f"| {label} |")]
        assert line.endswith(f"| {sizes._mb(value)} |"), line


def test_the_section_lists_the_layers_the_dockerfile_added_not_the_bases():
    sizes = _image_size_module()
    history = [  # docker history's rows, newest first: two of ours (one empty), then the base's
        {"bytes": 0, "created_by": 'ENTRYPOINT ["remoteloader-server"]'},
        {"bytes": 340_000_000, "created_by": "RUN |1 A=b /bin/sh -c apt-get update && pip install ..."},
        {"bytes": 2_500_000, "created_by": "COPY server ./server # buildkit"},
        {"bytes": 100_000_000, "created_by": "/bin/sh -c #(nop) ADD file:... in /"},
        {"bytes": 25_000_000, "created_by": "RUN /bin/sh -c set -eux; ... python"},
    ]
    figures = {"date": "2026-12-07", "engine": "Docker 28.2.2", "how": "docker build ...", "base": "python:3.11-slim",
               "image_bytes": 467_500_000, "base_bytes": 125_000_000, "layers": history,
               "site_packages": {"opencv-python-headless": 180_000_000, "grpcio": 19_000_000}}
    assert sizes.own_layers(figures) == history[:3]
    text = sizes.render(figures)
    assert "The server image weighs **468 MB**" in text and "342 MB of its own layers" in text
    assert "| `RUN /1 A=b /bin/sh -c apt-get update && pip install ...` | 340 MB |" in text
    assert "ADD file" not in text and "ENTRYPOINT" not in text  # the base's, and an empty one
    assert "| **all** | **199 MB** |" in text


def test_site_packages_sizes_are_each_distributions_recorded_files(tmp_path):
    sizes = _image_size_module()
    made = {"alpha": {"alpha/__init__.py": 1000, "alpha/core.so": 25_000}, "Beta_Pkg": {"beta.py": 300}}
    for name, files in made.items():
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        for path, size in files.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_bytes(b"x" * size)
        listed = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
        (info / "RECORD").write_text("".join(f"{path},,\n" for path in listed))
    (tmp_path / "stray.pth").write_text("x" * 7)
    (tmp_path / "alpha" / "__init__.py").unlink()  # listed, then pruned: no longer counted
    found = sizes.site_packages(str(tmp_path))
    metadata = {n: (tmp_path / f"{n}-1.0.dist-info" / "METADATA").stat().st_size
                + (tmp_path / f"{n}-1.0.dist-info" / "RECORD").stat().st_size for n in ("alpha", "Beta_Pkg")}
    assert found == {"alpha": 25_000 + metadata["alpha"], "beta-pkg": 300 + metadata["Beta_Pkg"], "(unrecorded)": 7}


def _prune_module():
    spec = importlib.util.spec_from_file_location("prune_site_packages", PRUNE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_prunes_after_the_install_while_binutils_are_there_and_keeps_pip():
    stages = _dockerfile()
    server = stages["server"]
    copies = [shlex.split(value) for value in server.all("COPY")]
    assert any(str(PRUNE.relative_to(ROOT)) in args[:-1] for args in copies), "the prune script is not copied"
    (run,) = [value for value in server.all("RUN") if "pip install" in value]
    steps = [step.strip() for step in run.split("&&")]

    def index(pattern: str) -> int:
        found = [i for i, step in enumerate(steps) if re.search(pattern, step)]
        assert found, f"no step matches {pattern!r} in {steps}"
        return found[0]

    # In the same RUN (what it deletes never reaches a layer), after the install, before the
    # compiler (and binutils' strip with it) is purged.
    install = index(r"pip install [\"']?\.\[server\]")
    prune = index(r"^python3? deploy/prune_site_packages\.py$")
    purge = index(r"apt-get purge .*\bgcc\b")
    assert index(r"apt-get install .*\bgcc\b") < install < prune < purge, steps
    # The trainer stage installs torch with the pip the server stage keeps.
    assert "pip install" in " ".join(stages["trainer"].all("RUN"))
    assert "pip" in _prune_module().BASE_IMAGE


def _loaded_by(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1"),
    )


def test_the_prune_keeps_every_module_the_server_imports_and_its_check_fails_without_one(tmp_path, monkeypatch):
    # What the server imports, read in a fresh interpreter of the test environment.
    server = _loaded_by(
        "import json, os, sys\n"
        "import remoteloader.server.cli, remoteloader.server.app, remoteloader.server.worker_process\n"
        "import remoteloader.server.pipelines\n"
        "print(json.dumps(sorted({os.path.realpath(m.__file__) for m in list(sys.modules.values())\n"
        "                         if isinstance(getattr(m, '__file__', None), str)})))\n"
    )
    # The script's own check, run where scipy.special (all the server uses of scipy) is missing.
    blocked = _loaded_by(
        "import runpy, sys\n"
        "sys.modules['scipy.special'] = None\n"
        f"sys.argv = [{str(PRUNE)!r}, '--probe', {str(tmp_path / 'loaded.json')!r}]\n"
        f"runpy.run_path({str(PRUNE)!r}, run_name='__main__')\n"
    )
    out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    loaded = json.loads(out)
    prune = _prune_module()
    # As in the image, where albumentations is the one distribution that requires scipy (this
    # environment has more, whose imports would keep more of scipy, and take seconds to read).
    monkeypatch.setattr(prune, "_dependents", lambda top: [importlib.metadata.distribution("albumentations")])
    removals = prune.plan(loaded, sites=[])  # scipy's subpackages and libraries (tests folders: below)
    names = {pathlib.Path(p).name for p in removals}
    assert {"stats", "optimize", "sparse", "linalg"} <= names, names  # it does prune
    assert not {"special", "_lib"} & names, names
    kept_away = [f for f in map(pathlib.Path, loaded) if any(r == f or r in f.parents for r in removals)]
    assert not kept_away, f"the prune would remove what the server imports: {kept_away[:5]}"
    in_tests = [f for f in loaded if prune.TESTS_DIR in pathlib.Path(f).parts and "site-packages" in f]
    assert not in_tests, in_tests
    top_level = {m.split(".")[0] for m in prune.server_requirement_modules()}
    assert {"cv2", "albumentations", "grpc", "numpy", "zstandard", "simplejpeg"} <= top_level, top_level
    _, err = blocked.communicate(timeout=60)
    assert blocked.returncode != 0 and "scipy.special" in err, err[-2000:]


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (/proc/PID/status, SigCgt)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _signal_once_caught(process: subprocess.Popen, signum: int, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not _catches(process.pid, signum):
        assert process.poll() is None, "it exited before it handled signals"
        assert time.monotonic() < deadline, f"no handler for signal {signum} within {within:g}s"
        time.sleep(0.005)
    process.send_signal(signum)


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_sigterm_while_the_server_starts_ends_it_at_once(tmp_path):
    """As a container's PID 1 a signal without a handler is ignored (docker stop then waits out
    its grace and kills): the server handles SIGTERM from its first moment, not once serving."""
    data = make_imagefolder(tmp_path / "data", ["x"], 2, size=(16, 16))
    process = subprocess.Popen([_script_path("remoteloader-server"), "--data", str(data), "--port", "0"],
                               stderr=subprocess.PIPE, text=True)
    try:
        _signal_once_caught(process, signal.SIGTERM)
        started = time.monotonic()
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "stopped while starting (SIGTERM)" in stderr and "listening on" not in stderr, stderr
    assert time.monotonic() - started < 10


# ---- run what compose runs ------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose_server(tmp_path_factory):
    """loader-0 exactly as compose starts it, but on a local ImageFolder, free ports (it binds
    them: --port 0, REMOTELOADER_HEALTH_PORT=-1) and 127.0.0.1."""
    service = _compose()["services"]["loader-0"]
    stages = _dockerfile()
    data = make_imagefolder(tmp_path_factory.mktemp("compose-data"), ["x", "y"], 5, size=(48, 64), seed=5)
    entry = _exec_form(_inherited(stages, "server", "ENTRYPOINT"))
    command = list(service["command"])
    argv = [_script_path(entry[0])] + entry[1:]
    for i, arg in enumerate(command):
        if arg == "/data":
            arg = str(data)
        elif i > 0 and command[i - 1] == "--port":
            assert arg == str(CONTAINER_PORT)
            arg = "0"
        argv.append(arg)
    assert str(data) in argv and argv[argv.index("--port") + 1] == "0", argv
    env = _container_env(service, stages)
    process = ServerProcess(argv, env=env)
    try:
        try:
            process.wait_ready(45)
        except ServerStartError as exc:
            pytest.fail(str(exc))
        process.container_env = _bound_health(env, process)  # what the HEALTHCHECK runs with, as inside the container
        yield process
    finally:
        process.kill()


def test_compose_server_command_serves_a_full_epoch(compose_server, run_bounded):
    from remoteloader.client import RemoteLoader

    address = f"127.0.0.1:{compose_server.port}"
    with RemoteLoader(address, batch_size=3, image_size=32, drop_last=False, return_ids=True,
                      connect_timeout=10) as loader:
        assert loader.num_samples == 10 and loader.class_names == ["x", "y"]
        ids = [i for _images, _labels, batch in run_bounded(loader, 60) for i in batch.tolist()]
    assert sorted(ids) == list(range(10))
    assert "with 2 workers" in compose_server.stderr(), compose_server.stderr()  # compose's --workers 2 took effect


def _container_env(service: dict, stages: dict[str, Stage]) -> dict[str, str]:
    """The environment of a server container: the image's ENV, then compose's, with the host
    and the health port moved for a test on this machine (a free one, which the server binds:
    ``_bound_health`` says which once it is ready)."""
    env = dict(_env(stages, "server"))  # the image's ENV (on top of ours, less its REMOTELOADER_* settings) ...
    env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})  # ... then compose's
    assert env["REMOTELOADER_HOST"] == "0.0.0.0"
    env["REMOTELOADER_HOST"] = "127.0.0.1"  # never bind other interfaces in tests
    env["REMOTELOADER_HEALTH_PORT"] = ANY_PORT
    return env


def _bound_health(env: dict[str, str], process: ServerProcess) -> dict[str, str]:
    """``env`` with the health port the ready ``process`` bound: the container's, as its HEALTHCHECK reads it."""
    assert process.health_port, f"the server logged no health port:\n{process.stderr()}"
    return {**env, "REMOTELOADER_HEALTH_PORT": str(process.health_port)}


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The image's HEALTHCHECK command, run with a container's environment."""
    health = _healthcheck(_dockerfile()["server"])
    argv = [_script_path(health[0])] + health[1:]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)


def test_healthcheck_command_against_the_server_and_a_free_port(compose_server, closed_port):
    ok = _probe(compose_server.container_env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "SERVING" in ok.stdout
    started = time.monotonic()
    down = _probe({**compose_server.container_env, "REMOTELOADER_HEALTH_PORT": str(closed_port())})
    assert down.returncode != 0, down.stdout + down.stderr
    assert time.monotonic() - started < 20


def test_health_checks_pass_with_tls_a_token_and_any_port(tmp_path):
    """The image's HEALTHCHECK and the kubelet's grpc probes (plaintext, no token) pass against
    a server on another port with TLS and a token; the Loader service is not on the health port."""
    import grpc
    from cryptography import x509
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from remoteloader.protos import SERVICE
    from remoteloader.tools.certificates import SERVER_AUTH, ip_san, make_ca, make_leaf, write_cert, write_key

    ca_key, ca_cert = make_ca("health test CA")
    key, cert = make_leaf(ca_key, ca_cert, "loader", SERVER_AUTH, [ip_san("127.0.0.1"), x509.DNSName("localhost")])
    token = tmp_path / "token"
    token.write_text("t" * 32)
    data = make_imagefolder(tmp_path / "data", ["x"], 2, size=(16, 16))
    env = _container_env(_compose()["services"]["loader-0"], _dockerfile())
    argv = [_script_path("remoteloader-server"), "--data", str(data), "--port", "0", "--workers", "1",
            "--tls-cert", write_cert(tmp_path / "server.pem", cert), "--tls-key", write_key(tmp_path / "key", key),
            "--token-file", str(token)]
    process = ServerProcess(argv, env=env)
    try:
        port = process.wait_ready(45)
        env = _bound_health(env, process)
        ok = _probe(env)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
        health_port = int(env["REMOTELOADER_HEALTH_PORT"])
        statefulset, _ = _statefulset_and_service()
        (container,) = statefulset["spec"]["template"]["spec"]["containers"]
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:  # as the kubelet asks
            stub = health_pb2_grpc.HealthStub(channel)
            for probe in ("readinessProbe", "livenessProbe"):
                service = container[probe]["grpc"].get("service", "")
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, probe
            describe = channel.unary_unary(f"/{SERVICE}/Describe")
            with pytest.raises(grpc.RpcError) as refused:
                describe(b"", timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        plain = _probe({**env, "REMOTELOADER_HEALTH_PORT": "0", "REMOTELOADER_PORT": str(port)})
        assert plain.returncode != 0, "plaintext health on the TLS port"
        ca = write_cert(tmp_path / "ca.pem", ca_cert)
        tls = subprocess.run([_script_path("remoteloader"), "probe", "--tls", ca, f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=30)
        assert tls.returncode == 0 and "SERVING" in tls.stdout, tls.stdout + tls.stderr
    finally:
        process.kill()


def test_compose_server_exits_0_on_sigterm(compose_server):
    assert compose_server.alive()
    compose_server.signal(signal.SIGTERM)
    code = compose_server.wait(40)  # compose's stop_grace_period
    if code is None:
        pytest.fail(f"no exit within 40s of SIGTERM:\n{compose_server.stderr()}")
    compose_server.reap()  # the whole output read
    assert code == 0, compose_server.stderr()
    assert "draining" in compose_server.stderr()


# ---- Kubernetes -----------------------------------------------------------------------------
_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}


def _kustomize(folder: pathlib.Path) -> list[dict]:
    """What ``kubectl kustomize folder`` builds, for what our kustomizations use: resources
    (files, or folders with a kustomization) and JSON 6902 patches with a target; anything
    else fails here, so that these tests never check less than kubectl applies."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kustomization) <= _KUSTOMIZATION_KEYS, f"{folder}: {set(kustomization) - _KUSTOMIZATION_KEYS}"
    docs: list[dict] = []
    for resource in kustomization["resources"]:
        path = (folder / resource).resolve()
        assert path.exists(), f"{folder}/kustomization.yaml: resource {resource} does not exist"
        if path.is_dir():
            # kustomize refuses a folder that contains the one that names it ("cycle detected").
            assert not folder.resolve().is_relative_to(path), f"{folder} is inside its resource {resource}"
            docs += _kustomize(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matched = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]
                   and d["apiVersion"] == "/".join(filter(None, (target.get("group"), target.get("version"))))]
        assert len(matched) == 1, f"{folder}: patch {patch['path']} matches {len(matched)} objects"
        patched = _json_patch(matched[0], yaml.safe_load((folder / patch["path"]).read_text()))
        docs[docs.index(matched[0])] = patched
    return docs


def _json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 as kustomize applies it (the operations our patches use: test, replace, remove, add)."""
    import copy

    document = copy.deepcopy(document)
    for operation in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
        node = document
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
        op = operation["op"]
        if op == "test":
            assert node[key] == operation["value"], f"patch test failed at {operation['path']}: {node[key]!r}"
        elif op == "replace":
            assert (key in node) if isinstance(node, dict) else key < len(node), f"nothing to replace: {operation}"
            node[key] = operation["value"]
        elif op == "remove":
            del node[key]
        elif op == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else key, operation["value"])
            else:
                node[key] = operation["value"]
        else:
            raise AssertionError(f"operation {op!r} is not handled here")
    return document


def _k8s_documents() -> list[dict]:
    return _kustomize(K8S)


def _statefulset_and_service(docs: list[dict] | None = None):
    docs = _k8s_documents() if docs is None else docs
    sets = [d for d in docs if d["kind"] == "StatefulSet"]
    assert len(sets) == 1, [d["kind"] for d in docs]
    statefulset = sets[0]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    return statefulset, services


def test_k8s_files_parse_and_kustomization_lists_them():
    docs = _k8s_documents()
    assert docs and all("kind" in d and "apiVersion" in d for d in docs)
    listed = set()
    for folder in (K8S, K8S / "base", K8S / "autoscaling", K8S / "object-store"):
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
        listed |= {(folder / r).resolve() for r in kustomization["resources"]}
        listed |= {(folder / p["path"]).resolve() for p in kustomization.get("patches", [])}
    manifests = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    helm_values = {(K8S / "autoscaling" / "prometheus-adapter.yaml").resolve()}  # for helm, not kubectl
    assert manifests - helm_values <= listed, f"manifests no kustomization applies: {manifests - helm_values - listed}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("folder", ["", "autoscaling", "object-store"])
def test_kubectl_kustomize_builds_what_these_tests_check(folder):
    built = subprocess.run(["kubectl", "kustomize", str(K8S / folder)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(built.stdout), key=key) == sorted(_kustomize(K8S / folder), key=key)


def test_k8s_statefulset_has_a_headless_service_and_probes():
    statefulset, services = _statefulset_and_service()
    spec = statefulset["spec"]
    service = services.get(spec["serviceName"])
    assert service is not None, f"no Service named {spec['serviceName']}"
    assert service["spec"]["clusterIP"] == "None", "the Service must be headless"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items(), "the Service selects no pod"
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert "grpc" in ports and "health" in ports
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert int(env["REMOTELOADER_HEALTH_PORT"]) == ports["health"]
    for probe in ("readinessProbe", "livenessProbe"):
        grpc_probe = container[probe].get("grpc")
        assert grpc_probe, f"{probe} must use the gRPC health service"
        # The kubelet's grpc probes speak neither TLS nor tokens: the plaintext health port.
        assert grpc_probe["port"] == ports["health"], f"{probe} checks port {grpc_probe['port']}"
    assert container["readinessProbe"]["grpc"].get("service") == "remoteloader.v1.Loader"
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports or port["targetPort"] in ports.values(), port
    assert container["lifecycle"]["preStop"], "no preStop hook"
    requests = container["resources"]["requests"]
    assert requests.get("cpu") and requests.get("memory"), requests


# The "restricted" Pod Security Standard (kubernetes.io/docs/concepts/security/pod-security-standards),
# its rules as the admission controller checks them for a pod spec.
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}


def restricted_violations(pod: dict) -> list[str]:
    """What in a pod spec the restricted level forbids (empty: admitted)."""
    found = []
    context = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"{key} is set")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']} is of type {sorted(kinds - RESTRICTED_VOLUMES)}")
    if (context.get("seLinuxOptions") or {}).get("type") not in (None, "", "container_t", "container_init_t"):
        found.append("pod seLinuxOptions.type")
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        name = container["name"]
        own = container.get("securityContext") or {}
        if own.get("privileged"):
            found.append(f"{name}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        capabilities = own.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{name}: capabilities must drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities {capabilities['add']}")
        if own.get("runAsNonRoot", context.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if own.get("runAsUser", context.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (own.get("seccompProfile") or context.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile.type must be RuntimeDefault or Localhost (is {seccomp})")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
        if own.get("procMount") not in (None, "Default"):
            found.append(f"{name}: procMount")
    return found


@pytest.mark.parametrize("folder", ["", "autoscaling", "object-store"])
def test_k8s_pods_meet_the_restricted_pod_security_level(folder):
    pods = [d["spec"]["template"]["spec"] for d in _kustomize(K8S / folder) if d["kind"] in POD_OWNERS]
    assert pods
    for pod in pods:
        assert restricted_violations(pod) == []
    # The checker is not blind: the base pod without its security settings fails it.
    loose = copy.deepcopy(pods[0])
    del loose["securityContext"]["seccompProfile"]
    del loose["containers"][0]["securityContext"]
    assert len(restricted_violations(loose)) == 3, restricted_violations(loose)


def test_k8s_start_up_waits_for_indexing_and_keeps_indexes_across_restarts():
    statefulset, _ = _statefulset_and_service()
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    startup = container["startupProbe"]
    assert startup["grpc"]["port"] == {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    # Our own figure: an index-less tar shard is scanned at 48 s per million samples.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 48 * 10, "under ten million samples"
    assert "initialDelaySeconds" not in container["livenessProbe"], "the startupProbe gates liveness"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["data"].get("readOnly") and "emptyDir" in volumes["cache"]
    assert mounts["cache"]["mountPath"] == "/home/loader/.cache" and not mounts["cache"].get("readOnly")
    # ... which is where the image's server keeps its cache (and so the indexes of read-only tars).
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "useradd --create-home --uid 10001 loader" in dockerfile and "/home/loader/.cache" in dockerfile
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert "REMOTELOADER_CACHE_DIR" not in env


def _substituted_args(container: dict) -> tuple[list[str], dict[str, str]]:
    env = {}
    for item in container.get("env", []):
        env[item["name"]] = str(item["value"]) if "value" in item else "0"  # fieldRefs: the pod index, 0
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    assert not any("$(" in a for a in args), args
    return args, env


def test_k8s_args_are_accepted_by_the_server(tmp_path):
    statefulset, _ = _statefulset_and_service()
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args, env = _substituted_args(container)
    namespace = _parse(_server_parser(), args, env)
    # The container port named grpc is the one the server listens on, metrics likewise.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert namespace.port == ports["grpc"]
    assert namespace.health_port == ports["health"]
    assert namespace.metrics_port == ports["metrics"]
    assert str(namespace.metrics_port) == statefulset["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"]
    assert namespace.host == "0.0.0.0"  # from REMOTELOADER_HOST
    # Files the args name live on mounted volumes of the right kind.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_of(path: str) -> dict:
        best = max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")), key=len, default=None)
        assert best is not None, f"{path} is on no mounted volume"
        return volumes[mounts[best]]

    assert "secret" in volume_of(namespace.token_file)
    for path in namespace.data:
        assert "persistentVolumeClaim" in volume_of(path)
    assert volume_of("/dev/shm")["emptyDir"]["medium"] == "Memory"
    # The whole configuration is valid once the token file exists (log format etc.).
    token = tmp_path / "token"
    token.write_text("x" * 32)
    namespace.token_file = str(token)
    config = config_module.from_args(namespace)
    assert config.log_format == "json" and config.grace > 0


def test_k8s_termination_grace_covers_prestop_and_drain():
    statefulset, _ = _statefulset_and_service()
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args, env = _substituted_args(container)
    grace = _parse(_server_parser(), args, env).grace
    assert grace is not None, "pass --grace explicitly so the pod's grace period can be checked"
    termination = pod["terminationGracePeriodSeconds"]
    assert termination > grace
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    sleep = float(command[1]) if command[0] == "sleep" else 0.0
    assert termination > sleep + grace, (termination, sleep, grace)


# ---- Kubernetes: autoscaling ----------------------------------------------------------------
AUTOSCALING = K8S / "autoscaling"


def _autoscaled() -> tuple[dict, dict]:
    """What ``kubectl apply -k deploy/k8s/autoscaling`` applies: (StatefulSet, HorizontalPodAutoscaler)."""
    docs = _kustomize(AUTOSCALING)
    statefulset, _ = _statefulset_and_service(docs)
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    return statefulset, hpa


def _adapter_rule(metric: str) -> dict:
    values = yaml.safe_load((AUTOSCALING / "prometheus-adapter.yaml").read_text())
    rules = [r for r in values["rules"]["custom"] if r["name"]["as"] == metric]
    assert len(rules) == 1, f"{len(rules)} prometheus-adapter rules name the metric {metric!r}"
    return rules[0]


def _quantity(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_k8s_hpa_scales_the_statefulset_whose_every_pod_serves_the_whole_dataset(tmp_path):
    statefulset, hpa = _autoscaled()
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        statefulset["apiVersion"], "StatefulSet", statefulset["metadata"]["name"])
    assert "replicas" not in statefulset["spec"], "a replica count in the manifest resets the HPA's at every apply"
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    assert 0 < _quantity(metric["pods"]["target"]["averageValue"]) < 1  # a share of busy workers
    _adapter_rule(metric["pods"]["metric"]["name"])
    # Scaling down waits out an epoch's pauses (validation, the end of an epoch).
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    # Every pod serves the same data, whatever its index: a pod added or removed changes who
    # serves the samples, not which samples there are.
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    datas = set()
    for index in ("0", "7"):
        env = {e["name"]: index if "valueFrom" in e else str(e["value"]) for e in container["env"]}
        args = [re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a) for a in container["args"]]
        namespace = _parse(_server_parser(), args, env)
        datas.add(tuple(namespace.data))
        assert namespace.metrics_port, "the HPA's metric comes from --metrics-port"
        assert namespace.grace, "pods removed by a scale-down drain for --grace"
    assert datas == {("/data",)}, datas


@pytest.fixture(scope="module")
def metrics_text(module_cluster, tmp_path_factory, run_bounded):
    """/metrics of a real server after it served an epoch."""
    import urllib.request

    from remoteloader.client import RemoteLoader

    data = make_imagefolder(tmp_path_factory.mktemp("metrics-data"), ["x", "y"], 6, size=(48, 64), seed=2)
    index = module_cluster.add(data, "--metrics-port", ANY_PORT)
    port = module_cluster.metrics_port(index)
    with RemoteLoader(module_cluster.address(index), batch_size=4, image_size=32, drop_last=False,
                      connect_timeout=10) as loader:
        run_bounded(loader, 60)
    # The server ends the closed loader's stream on its own time (later on a loaded machine):
    # read until its orders are gone, for a bound; the test then asserts they are.
    deadline = time.monotonic() + 20
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        if re.search(r"^remoteloader_queued_orders 0(\.0)?$", text, re.M) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_the_adapter_rule_reads_series_the_server_exports(metrics_text):
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for family in text_string_to_metric_families(metrics_text) for s in family.samples}
    types = {f.name: f.type for f in text_string_to_metric_families(metrics_text)}
    _, hpa = _autoscaled()
    rule = _adapter_rule(hpa["spec"]["metrics"][0]["pods"]["metric"]["name"])
    series = re.fullmatch(r"(\w+)\{.*\}", rule["seriesQuery"].strip())
    assert series, rule["seriesQuery"]
    assert series.group(1) in samples, f"the rule's series {series.group(1)} is not in /metrics"
    assert re.search(rule["name"]["matches"], series.group(1)), rule["name"]
    # rate() is taken of a counter only, and every series the query names is exported.
    assert "rate(<<.Series>>" in rule["metricsQuery"] and types[series.group(1).removesuffix("_total")] == "counter"
    named = set(re.findall(r"\bremoteloader_\w+", rule["metricsQuery"]))
    assert named <= set(samples), f"the query names series the server does not export: {named - set(samples)}"
    assert {o["resource"] for o in rule["resources"]["overrides"].values()} == {"namespace", "pod"}
    # What the rule computes is what it says: busy worker-seconds were counted while the epoch ran.
    assert samples["remoteloader_worker_busy_seconds_total"] > 0
    assert samples["remoteloader_workers"] == 1
    assert 0 <= samples["remoteloader_workers_busy_ratio"] <= 1
    assert samples["remoteloader_queued_orders"] == 0  # the epoch is over


def test_deploy_guide_names_every_metric_the_server_exports(metrics_text):
    guide = (ROOT / "docs" / "deploy.md").read_text()
    names = {line.split()[2] for line in metrics_text.splitlines() if line.startswith("# TYPE remoteloader_")}
    names = {n for n in names if not n.endswith("_created")}  # prometheus_client's creation times
    missing = sorted(n for n in names if n not in guide)
    assert not missing, f"docs/deploy.md does not mention {missing}"


# ---- CI ------------------------------------------------------------------------------------
def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh|shell)?\n(.*?)```", readme, re.S)
    assert block, "no fenced block in README.md"
    commands = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) >= 2, commands
    test_command = commands[1]
    assert "pytest" in test_command
    ci = ROOT / ".ci" / "run"
    assert ci.is_file() and os.access(ci, os.X_OK), ".ci/run must exist and be executable"
    lines = [line.strip() for line in ci.read_text().splitlines()]
    assert test_command in lines, f"{test_command!r} is not a line of .ci/run"


def test_a_bad_environment_variable_is_named_and_a_misspelt_one_is_reported(monkeypatch, capsys, tmp_path):
    # One image serves every shard through REMOTELOADER_* variables: a wrong one must be found.
    from remoteloader.server.cli import serve_main

    for k in [k for k in os.environ if k.startswith(config_module.ENV_PREFIX)]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("REMOTELOADER_WORKERS", "two")
    with pytest.raises(SystemExit):
        serve_main(["--data", str(tmp_path)])
    assert "invalid int value: 'two' (from REMOTELOADER_WORKERS)" in capsys.readouterr().err
    monkeypatch.delenv("REMOTELOADER_WORKERS")
    monkeypatch.setenv("REMOTELOADER_WROKERS", "2")
    assert serve_main(["--data", str(tmp_path / "missing"), "--port", "0"]) == 2  # no such data: no server
    assert "REMOTELOADER_WROKERS is set but names no setting" in capsys.readouterr().err


# ---- object stores: compose's profile "s3" and the Kubernetes overlay, run against a real store --
def _shell(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A compose ``sh -c`` command ($$ is compose's escape of $), with our console scripts on PATH."""
    path = f"{pathlib.Path(_script_path('remoteloader')).parent}:{os.environ['PATH']}"
    return subprocess.run(["sh", "-c", command.replace("$$", "$")], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env, "PATH": path})


def test_compose_s3_profile_packs_the_demo_into_the_store_and_serves_it(tmp_path, run_bounded):
    from remoteloader.client import RemoteLoader
    from remoteloader.tools.local_s3 import LocalS3

    services = _compose()["services"]
    credentials = services["s3"]["environment"]
    bucket = _flag(services["s3"]["command"], "-bucket")
    # The store compose runs, with compose's credentials and bucket, on this machine.
    with LocalS3(tmp_path / "s3", buckets=(bucket,), access_key=credentials["AWS_ACCESS_KEY_ID"],
                 secret_key=credentials["AWS_SECRET_ACCESS_KEY"]) as store:
        local = {"AWS_ENDPOINT_URL": store.endpoint}  # compose's s3:8333 is this store here
        prepare = services["prepare-s3"]
        assert prepare["entrypoint"] == ["sh", "-c"]
        env = {**{k: str(v) for k, v in prepare["environment"].items()}, **local}
        command = prepare["command"][0].replace("/tmp/demo", str(tmp_path / "demo"))
        for attempt in ("first", "again"):  # a second `up` finds the shards there and goes on
            done = _shell(command, env)
            assert done.returncode == 0, f"{attempt}: {done.stdout}{done.stderr}"
        service = services["loader-s3"]
        stages = _dockerfile()
        entry = _exec_form(_inherited(stages, "server", "ENTRYPOINT"))
        argv = [_script_path(entry[0]), *entry[1:], *["0" if a == str(CONTAINER_PORT) else a
                                                      for a in service["command"]]]
        env = _container_env(service, stages)
        env.update(local)
        env["REMOTELOADER_CACHE_DIR"] = str(tmp_path / "cache")  # the service's cache volume
        process = ServerProcess(argv, env=env)
        try:
            port = process.wait_ready(60)
            env = _bound_health(env, process)
            ok = _probe(env)
            assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
            with RemoteLoader(f"127.0.0.1:{port}", batch_size=8, image_size=32, drop_last=False,
                              return_ids=True, connect_timeout=20) as loader:
                ids = [i for _x, _y, batch in run_bounded(loader, 60) for i in batch.tolist()]
                assert sorted(ids) == list(range(loader.num_samples)) and loader.num_samples > 0
        finally:
            process.kill()
    volume = next(v for v in service["volumes"] if v.endswith(".cache"))
    assert volume.split(":")[1] == "/home/loader/.cache", "the cache volume is not where the server keeps it"


def test_k8s_object_store_overlay_reads_the_bucket_with_the_secrets_credentials(tmp_path):
    statefulset, _ = _statefulset_and_service(_kustomize(K8S / "object-store"))
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args, env = _substituted_args(container)
    namespace = _parse(_server_parser(), args, env)
    assert [d for d in namespace.data if d.startswith("s3://")] == namespace.data, namespace.data
    assert container["envFrom"] == [{"secretRef": {"name": "remoteloader-s3"}}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "data" not in volumes and all(m["name"] != "data" for m in container["volumeMounts"])
    cache = next(m for m in container["volumeMounts"] if m["name"] == "cache")
    assert cache["mountPath"] == "/home/loader/.cache" and "emptyDir" in volumes["cache"]
    limit = volumes["cache"]["emptyDir"]["sizeLimit"]
    assert namespace.disk_cache_bytes < int(limit.rstrip("Gi")) * 2**30, "the cache limit exceeds the volume"
