"""Two sluice checkouts on `structured_output.py`'s workload B (32 clients, 8 JSON schemas),
interleaved round by round: a code A/B of the grammar path that the machine's drift does not
decide.

Both servers (this checkout, and `--base`, another one given as PYTHONPATH: `git worktree add
/tmp/base REV`) are up at once; each round runs B's 128 requests on one then the other, in an
order that alternates between rounds. Printed per round: each one's output tok/s and new / base;
then the median of the paired ratios (min, max), and per server the median CPU milliseconds per
output token of each of its processes (and of the load generator): CPU figures hold up better
than wall time on a shared machine, though spinning compute threads fill saved time.

    .venv/bin/python benchmarks/ab_structured.py --base /tmp/base [--rounds 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import proc_cpu  # noqa: E402
from serving import ServerProcess, free_port, sluice_command, sluice_origin  # noqa: E402
from structured_output import make_workloads, run_load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base", required=True, help="the other checkout's folder (its sluice runs)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    wl = make_workloads(args.num_requests)
    extra = ["--no-embedding-model", "--log-level", "warning"]
    envs = {"base": {**os.environ, "PYTHONPATH": args.base}, "new": dict(os.environ)}
    servers: dict[str, tuple[ServerProcess, str]] = {}
    tok_s: dict[str, list[float]] = {name: [] for name in envs}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in envs}
    with contextlib.ExitStack() as stack:
        for name, env in envs.items():
            print(f"{name}: sluice from {sluice_origin(env)}", flush=True)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            server = ServerProcess(name, sluice_command(port, extra), url, "/health_generate", env)
            servers[name] = (stack.enter_context(server), url + "/v1/chat/completions")
        for _, url in servers.values():
            run_load(url, wl.warm_b, len(wl.warm_b))  # compiles B's grammars
        for r in range(args.rounds):
            for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
                server, url = servers[name]
                meter = proc_cpu.TreeCpu(server.proc.pid)
                run = run_load(url, wl.b, args.concurrency)
                if run.errors:
                    raise SystemExit(f"{name}: {len(run.errors)} requests failed: {run.errors[:2]}")
                tok_s[name].append(run.tok_s)
                cpu[name].append(meter.ms_per(run.output_tokens))
            print(f"round {r + 1}: base {tok_s['base'][-1]:.1f}, new {tok_s['new'][-1]:.1f} "
                  f"tok/s, new / base {tok_s['new'][-1] / tok_s['base'][-1]:.3f}", flush=True)  # fmt: skip
    ratios = [n / b for n, b in zip(tok_s["new"], tok_s["base"], strict=True)]
    print(f"B new / base: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}; {sum(x > 1 for x in ratios)} of {len(ratios)} above 1); "
          f"median tok/s base {statistics.median(tok_s['base']):.1f}, "
          f"new {statistics.median(tok_s['new']):.1f}; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name, rows in cpu.items():
        medians = {k: statistics.median(row.get(k, 0.0) for row in rows) for k in rows[0]}
        print(f"{name} CPU ms per output token: {proc_cpu.describe(medians)}")


if __name__ == "__main__":
    main()
