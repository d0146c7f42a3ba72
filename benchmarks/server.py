"""Does the patched server pay for concurrent clients? Aggregate tokens/s against mlx-lm's server.

Servers, each a subprocess on 127.0.0.1 with the shipped demo pair (``mlx_spec/demo``):

- ``mlx-lm, draft``: ``python -m mlx_lm server --draft-model DRAFT``, which serves one request
  at a time (a draft model turns its batching off);
- ``mlx-lm``: ``python -m mlx_lm server`` without a draft model, which batches;
- ``mlx-spec, draft``: ``examples/serve.py --draft-model DRAFT``, which batches speculatively
  (:mod:`mlx_spec.serving`);
- ``mlx-spec, lookup``: ``examples/serve.py --prompt-lookup``, the same with prompt lookup.

Every server runs with ``--prompt-cache-size 0`` (mlx-lm's own speculative loop files caches it
cannot reuse, see ``docs/guide.md``), ``--num-draft-tokens`` ``--draft-tokens`` and greedy
requests of ``--tokens`` tokens to ``/v1/completions`` (``ignore_eos`` is not an option there,
so a request may end early: tokens/s counts the tokens each reply reports).

At each number of clients of ``--clients``, each client sends ``--requests`` requests one after
the other, the workload's prompts in turn (``input-grounded``: text that the output repeats;
``open``: the demo's prompts). Every server first serves one untimed load at each number of
clients (its first use of those shapes). Then ``--passes`` passes, each running every workload,
number of clients and server once, in an order reversed from one pass to the next, so that load
on the machine hits them alike. The table gives the median over passes of the aggregate
tokens/s (completion tokens of all clients over the load's wall time), the mean and longest
request latency, and tokens/s over each mlx-lm server's.

Usage: ``python benchmarks/server.py [--clients 1 8] [--workload input-grounded open]
[--requests 4] [--tokens 64] [--draft-tokens 3] [--passes 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlx_spec import bench
from mlx_spec._demo import DEMO_DIR, GROUNDED, PROMPTS

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "examples" / "serve.py"
TARGET, DRAFT = str(DEMO_DIR / "target"), str(DEMO_DIR / "draft")
WORKLOADS = {"input-grounded": GROUNDED, "open": PROMPTS}
#: name -> (command, whether it takes the draft model)
SERVERS = {
    "mlx-lm, draft": ([sys.executable, "-m", "mlx_lm", "server"], True),
    "mlx-lm": ([sys.executable, "-m", "mlx_lm", "server"], False),
    "mlx-spec, draft": ([sys.executable, str(SERVE)], True),
    "mlx-spec, lookup": ([sys.executable, str(SERVE), "--prompt-lookup"], False),
}
BASELINES = ("mlx-lm, draft", "mlx-lm")
START_TIMEOUT, REQUEST_TIMEOUT = 300, 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, draft_tokens: int) -> tuple[subprocess.Popen, int]:
    """Server ``name`` started, once it answers ``/health``: its process and port."""
    command, with_draft = SERVERS[name]
    port = free_port()
    args = ["--model", TARGET, *(["--draft-model", DRAFT] if with_draft else [])]
    args += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    args += ["--prompt-cache-size", "0", "--num-draft-tokens", str(draft_tokens)]
    env = {**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "0")}
    process = subprocess.Popen([*command, *args], env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server.py: the server {name!r} exited with {process.returncode}")
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return process, port
        except OSError:
            time.sleep(0.2)
        finally:
            connection.close()
    process.kill()
    raise SystemExit(f"server.py: the server {name!r} did not start in {START_TIMEOUT} s")


def complete(port: int, prompt: str, max_tokens: int) -> int:
    """One greedy completion: the tokens it generated."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    try:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        reply = json.loads(response.read())
        if response.status != 200:
            raise SystemExit(f"server.py: a request failed ({response.status}): {reply}")
        return reply["usage"]["completion_tokens"]
    finally:
        connection.close()


def load(port: int, prompts: Sequence[str], clients: int, requests: int, tokens: int) -> dict:
    """``clients`` clients at once, each sending ``requests`` requests in turn: the tokens, the
    wall time and each request's latency."""

    def client(c: int) -> list[tuple[int, float]]:
        done = []
        for i in range(requests):
            tic = time.perf_counter()
            generated = complete(port, prompts[(c + i) % len(prompts)], tokens)
            done.append((generated, time.perf_counter() - tic))
        return done

    start_time = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for part in pool.map(client, range(clients)) for r in part]
    seconds = time.perf_counter() - start_time
    return {
        "tokens": sum(t for t, _ in results),
        "seconds": seconds,
        "latencies": [s for _, s in results],
    }


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per workload, clients and server: medians over passes, and ratios."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["clients"], row["server"]), []).append(row)
    lines = []
    for (workload, clients, name), group in groups.items():
        lines.append(
            {
                "workload": workload,
                "clients": clients,
                "server": name,
                "tokens_per_second": statistics.median(r["tokens"] / r["seconds"] for r in group),
                "latency_mean": statistics.median(statistics.mean(r["latencies"]) for r in group),
                "latency_max": max(max(r["latencies"]) for r in group),
                "passes": len(group),
            }
        )
    speed = {(x["workload"], x["clients"], x["server"]): x["tokens_per_second"] for x in lines}
    for line in lines:
        for base in BASELINES:
            reference = speed.get((line["workload"], line["clients"], base))
            line[f"x {base}"] = line["tokens_per_second"] / reference if reference else None
    return lines


def table(lines: Sequence[dict[str, Any]]) -> str:
    header = "| workload | clients | server | tokens/s | " + " | ".join(
        f"x {base}" for base in BASELINES
    )
    out = [
        header + " | latency mean (s) | latency max (s) |",
        "|---" * (6 + len(BASELINES)) + "|",
    ]
    for x in lines:
        ratios = " | ".join(
            "-" if x[f"x {base}"] is None else f"{x[f'x {base}']:.2f}x" for base in BASELINES
        )
        out.append(
            f"| {x['workload']} | {x['clients']} | {x['server']} | {x['tokens_per_second']:.1f} | "
            f"{ratios} | {x['latency_mean']:.2f} | {x['latency_max']:.2f} |"
        )
    return "\n".join(out)


def measure(
    ports: dict[str, int],
    workloads: dict[str, list[str]],
    clients: Sequence[int],
    requests: int,
    tokens: int,
    passes: int,
    keep: Callable[[dict[str, Any]], None],
) -> None:
    """The untimed first loads, then ``passes`` interleaved passes (see the module)."""
    cases = [(w, c, name) for w in workloads for c in clients for name in ports]
    for workload, count, name in cases:
        load(ports[name], workloads[workload], count, 1, tokens)
    for p in range(passes):
        for workload, count, name in cases if p % 2 == 0 else cases[::-1]:
            print(f"[pass {p + 1}: {workload}, {count} clients, {name}]", file=sys.stderr)
            result = load(ports[name], workloads[workload], count, requests, tokens)
            keep({"workload": workload, "clients": count, "server": name, "pass": p, **result})


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workload", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--draft-tokens", type=int, default=3, help="--num-draft-tokens")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per workload, at most 4")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json", type=Path, help="the machine, settings and raw rows")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = setup_arg_parser().parse_args(argv)
    for name in ("requests", "tokens", "passes", "prompts"):
        if getattr(args, name) < 1:
            raise SystemExit(f"server.py: --{name} must be at least 1")
    if min(args.clients) < 1:
        raise SystemExit("server.py: --clients must be at least 1")
    workloads = {w: WORKLOADS[w][: args.prompts] for w in args.workload}
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    results, keep = bench.recorder(
        args.json, machine=bench.machine(), settings=settings, pair="pair demo"
    )

    m = results["machine"]
    print(
        f"# server: {m['date']}, {m['system']}, {m['cpu_count']} cores, MLX {m['mlx']} "
        f"({m['device']}), mlx-lm {m['mlx_lm']}; demo pair; greedy, {args.requests} requests "
        f"a client x {args.tokens} tokens, --num-draft-tokens {args.draft_tokens}; "
        f"{args.passes} passes\n",
        flush=True,
    )
    running = {}
    try:
        for name in args.servers:
            running[name] = start(name, args.draft_tokens)
        ports = {name: port for name, (_, port) in running.items()}
        measure(ports, workloads, args.clients, args.requests, args.tokens, args.passes, keep)
    finally:
        for process, _ in running.values():
            process.kill()
            process.wait()
    print(table(summarize(results["rows"])), flush=True)
    return results


if __name__ == "__main__":
    main()
