"""Loader servers behind shaped links, each in a network namespace of its own: real links for the
tests and benchmarks, without root and without another machine.

``python -m remoteloader.tools.shaped_links --rates 50,250 ...`` re-runs itself under
``unshare --user --map-root-user --net --mount``, where it is root of a network namespace of
its own (no route out). There it makes one namespace per server, joined to its own by a veth
pair in 198.18.0.0/15, the range kept for network benchmarks: server ``i`` at
``198.18.<i+1>.2``, this side ``198.18.<i+1>.1``. The server->trainer direction is shaped with
``tc tbf`` at the rate asked for (Mbit/s), so each server's link, not its CPU, is what limits it.
The servers bind that address (not loopback) with a token, and with TLS (``--tls``: a CA and a
certificate per server for its address, made for the run); by
default they serve the same ``--synthetic`` shard, so they are replicas and the loader
splits the work between them. A warm-up epoch is read, then a timed one, and a JSON report
printed: images/s, each server's share (and the ideal one, its rate over the sum), and the
utilization of the links' combined capacity by the samples delivered.

With ``--bench FLAGS...`` (last), ``remoteloader bench FLAGS`` runs against the servers instead
of the epoch, and prints what it prints: what bench says of a link of that speed.

``available()`` says why this cannot run here (no unshare, ip or tc, or user namespaces off),
for the tests to skip with that reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from remoteloader.client import cpu
from remoteloader.tools.local import ServerProcess, server_command

NAMESPACE = ["unshare", "--user", "--map-root-user", "--net", "--mount"]
TOKEN = "shaped-links-token-0123456789"


def available() -> str | None:
    """None when shaped links can be made here, else why not."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool} command"
    probe = subprocess.run(
        [
            *NAMESPACE,
            "sh",
            "-c",
            "mount -t tmpfs none /run && ip netns add rlprobe && ip link add name rlt0 type veth peer name rlt1 "
            "&& ip link set rlt1 netns rlprobe && tc qdisc add dev rlt0 root tbf rate 10mbit burst 32kb latency 50ms",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode:
        return f"cannot make a network namespace with a shaped veth pair: {probe.stderr.strip() or probe.returncode}"
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", "netns", "exec", netns, *args] if netns else list(args)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")


def make_link(i: int, rate_mbit: float) -> str:
    """Namespace ``rl<i>`` joined to this one, its egress (towards us) shaped; returns its address."""
    ns, near, far = f"rl{i}", f"rl{i}a", f"rl{i}b"
    host, server = f"198.18.{i + 1}.1", f"198.18.{i + 1}.2"
    _ip("ip", "netns", "add", ns)
    _ip("ip", "link", "add", "name", near, "type", "veth", "peer", "name", far)
    _ip("ip", "link", "set", far, "netns", ns)
    _ip("ip", "addr", "add", f"{host}/30", "dev", near)
    _ip("ip", "link", "set", near, "up")
    _ip("ip", "addr", "add", f"{server}/30", "dev", far, netns=ns)
    _ip("ip", "link", "set", far, "up", netns=ns)
    _ip("ip", "link", "set", "lo", "up", netns=ns)
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 100))  # at least 10 ms of the rate
    _ip(
        "tc",
        "qdisc",
        "add",
        "dev",
        far,
        "root",
        "tbf",
        "rate",
        f"{rate_mbit}mbit",
        "burst",
        str(burst),
        "latency",
        "100ms",
        netns=ns,
    )
    return server


def _start_servers(args: argparse.Namespace, work: pathlib.Path, servers: list[ServerProcess]) -> list[str]:
    """In our own namespace: a server behind a shaped link per rate (appended to ``servers`` as
    they start, for the caller to stop); returns their addresses once all listen."""
    subprocess.run(["mount", "-t", "tmpfs", "none", "/run"], check=True)  # for `ip netns` (our own mount namespace)
    _ip("ip", "link", "set", "lo", "up")
    token = work / "token"
    token.write_text(TOKEN)
    flags = ["--token-file", str(token), "--workers", "1", "--log-level", "WARNING"]
    for i, rate in enumerate(args.rates):
        host = make_link(i, rate)
        certificate = ["--tls-cert", str(work / f"server{i}.pem"), "--tls-key", str(work / f"server{i}.key")]
        data = ["--synthetic", str(args.samples)] if not args.data else ["--data", *args.data]
        argv = [
            "ip",
            "netns",
            "exec",
            f"rl{i}",
            *server_command(),
            *data,
            "--host",
            host,
            "--port",
            "50051",
            *flags,
            *(certificate if args.tls else []),
            *args.server_args,
        ]
        servers.append(ServerProcess(argv, log_path=work / f"server{i}.log"))
    for server in servers:
        server.wait_ready(60)
    return [f"{server.host}:{server.port}" for server in servers]


class _Behind(NamedTuple):
    addresses: list[str]
    servers: list[ServerProcess]
    tls: Any  # the client's TLSConfig with --tls, else None
    token_file: pathlib.Path


@contextlib.contextmanager
def _behind_links(args: argparse.Namespace) -> Iterator[_Behind]:
    """In our own namespace: the servers behind their links (a token; TLS with --tls); stopped
    on the way out."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="shaped-links-"))
    tls = _certificates(work, len(args.rates)) if args.tls else None
    servers: list[ServerProcess] = []
    try:
        yield _Behind(_start_servers(args, work, servers), servers, tls, work / "token")
    finally:
        for server in servers:
            server.stop(10)


def _bench_inside(args: argparse.Namespace) -> int:
    """``remoteloader bench`` against the servers behind their links; its output as it is."""
    with _behind_links(args) as behind:
        security = ["--token-file", str(behind.token_file), *(["--tls", behind.tls.ca] if behind.tls else [])]
        return subprocess.call(
            [sys.executable, "-m", "remoteloader.tools.cli", "bench", ",".join(behind.addresses), *security]
            + args.bench_args
        )


def _run_inside(args: argparse.Namespace) -> dict:
    from remoteloader.client import RemoteLoader

    with _behind_links(args) as (addresses, servers, tls, _):
        loader = RemoteLoader(
            addresses,
            batch_size=args.batch_size,
            image_size=args.image_size,
            pipeline="eval",
            token=TOKEN,
            tls=tls,
            return_ids=True,
            seed=1,
            **json.loads(args.loader_args),
        )
        with loader:
            loader.set_epoch(0)
            for _ in loader:  # warm-up epoch: connections, rates measured
                pass
            before = loader.stats()["servers"]
            loader.set_epoch(1)
            seen = []
            server_cpu = [cpu.tree_cpu(server.popen.pid) for server in servers]
            trainer_cpu = os.times()
            started = time.perf_counter()
            for _images, _labels, ids in loader:
                seen.extend(ids.tolist())
            seconds = time.perf_counter() - started
            trainer = os.times()
            server_seconds = sum(cpu.tree_cpu(server.popen.pid) - c for server, c in zip(servers, server_cpu))
            after = loader.stats()["servers"]
        sample_bytes = args.image_size * args.image_size * 3
        per_server = {}
        for address, rate in zip(addresses, args.rates):
            images = after[address]["samples"] - before[address]["samples"]
            per_server[address] = {"rate_mbit": rate, "images": images}
        total = sum(s["images"] for s in per_server.values())
        capacity = sum(args.rates) * 1e6 / 8 * seconds  # bytes the links could carry in that time
        for s in per_server.values():
            s["share"] = s["images"] / total if total else 0.0
            s["ideal_share"] = s["rate_mbit"] / sum(args.rates)
            s["utilization"] = s["images"] * sample_bytes / (s["rate_mbit"] * 1e6 / 8 * seconds)
        return {
            "rates_mbit": args.rates,
            "samples": len(seen),
            "distinct": len(set(seen)),
            "expected": len(loader),
            "seconds": seconds,
            "images_per_s": len(seen) / seconds,
            # What the epoch delivered (each sample once) over what the links could carry; the
            # servers' own counts include the twins of hedged orders (client/engine.py).
            "utilization": len(seen) * sample_bytes / capacity,
            "duplicates": total - len(seen),
            # CPU per image delivered: the servers' (their decode workers included) and this
            # process's (the trainer's: receiving, decoding a wire encoding, the loop).
            "server_cpu_ms_per_image": server_seconds * 1e3 / max(1, len(seen)),
            "trainer_cpu_ms_per_image": (trainer.user + trainer.system - trainer_cpu.user - trainer_cpu.system)
            * 1e3
            / max(1, len(seen)),
            "wire_bytes_per_image": sum(after[a]["bytes"] - before[a]["bytes"] for a in addresses) / max(1, total),
            "servers": per_server,
        }


def _certificates(work: pathlib.Path, count: int):
    """A CA, and a certificate for each server's address signed by it; the loader's TLSConfig."""
    from remoteloader.client import TLSConfig
    from remoteloader.tools.certificates import SERVER_AUTH, ip_san, make_ca, make_leaf, write_cert, write_key

    ca_key, ca_cert = make_ca("shaped links CA")
    for i in range(count):
        key, cert = make_leaf(ca_key, ca_cert, f"loader {i}", SERVER_AUTH, [ip_san(f"198.18.{i + 1}.2")])
        write_cert(work / f"server{i}.pem", cert)
        write_key(work / f"server{i}.key", key)
    return TLSConfig(write_cert(work / "ca.pem", ca_cert))


def measure(rates: list[float], timeout: float = 300, **options) -> dict:
    """Runs one shaped epoch in a fresh user and network namespace; returns its report.

    Options: samples, image_size, batch_size, tls (bool), data (paths), loader_args (dict),
    server_args (list)."""
    argv = [sys.executable, "-m", "remoteloader.tools.shaped_links", "--inside", "--rates", ",".join(map(str, rates))]
    for name in ("samples", "image_size", "batch_size"):
        if name in options:
            argv += [f"--{name.replace('_', '-')}", str(options[name])]
    if options.get("tls"):
        argv.append("--tls")
    if options.get("data"):
        argv += ["--data", *map(str, options["data"])]
    argv += ["--loader-args", json.dumps(options.get("loader_args", {}))]
    for flag in options.get("server_args", []):
        argv.append(f"--server-arg={flag}")
    result = subprocess.run(
        [*NAMESPACE, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if result.returncode:
        raise RuntimeError(f"shaped-link run failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates",
        type=lambda t: [float(v) for v in t.split(",")],
        required=True,
        help="each server's link, Mbit/s, comma-separated",
    )
    parser.add_argument("--samples", type=int, default=20000, help="samples of the synthetic shard")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--tls", action="store_true", help="servers serve TLS (a CA made for the run)")
    parser.add_argument("--data", nargs="*", default=None, help="serve these paths instead of a synthetic shard")
    parser.add_argument("--loader-args", default="{}", help="JSON of further RemoteLoader arguments")
    parser.add_argument("--server-arg", dest="server_args", action="append", default=[])
    parser.add_argument(
        "--bench",
        dest="bench_args",
        nargs=argparse.REMAINDER,
        default=None,
        help="instead of an epoch, run `remoteloader bench` against the servers with these flags (the rest)",
    )
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside and args.bench_args is not None:
        return _bench_inside(args)
    if not args.inside:
        reason = available()
        if reason:
            print(f"shaped links cannot be made here: {reason}", file=sys.stderr)
            return 2
        if args.bench_args is not None:
            return subprocess.call(
                [
                    *NAMESPACE,
                    sys.executable,
                    "-m",
                    "remoteloader.tools.shaped_links",
                    "--inside",
                    *(argv if argv is not None else sys.argv[1:]),
                ]
            )
        report = measure(
            args.rates,
            samples=args.samples,
            image_size=args.image_size,
            batch_size=args.batch_size,
            tls=args.tls,
            data=args.data,
            loader_args=json.loads(args.loader_args),
            server_args=args.server_args,
        )
        print(json.dumps(report, indent=2))
        return 0
    print(json.dumps(_run_inside(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
