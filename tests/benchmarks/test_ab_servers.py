"""ab_servers.py's pieces that need no server: the --config syntax, the pairing of trials and
the alternating order."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def ab() -> ModuleType:
    return load_benchmark("ab_servers")


def test_a_config_is_a_label_then_environment_then_flags(ab: ModuleType) -> None:
    assert ab.parse_config("omp") == ab.Config("omp", {}, [])
    pool = ab.parse_config("pool:SLUICE_KERNEL_POOL=1, OMP_WAIT_POLICY=PASSIVE")
    assert pool == ab.Config("pool", {"SLUICE_KERNEL_POOL": "1", "OMP_WAIT_POLICY": "PASSIVE"}, [])
    one = ab.parse_config("one-thread::--num-threads 1 --chunked-prefill-size 512")
    assert one == ab.Config(
        "one-thread", {}, ["--num-threads", "1", "--chunked-prefill-size", "512"]
    )
    assert ab.parse_config("x:A=b=c").env == {"A": "b=c"}  # the first '=' splits


@pytest.mark.parametrize(
    "spec", [":A=1", "x:A", "x:=1", "x:OMP_WAIT_POLICY=active", "x::--omp-wait-policy active"]
)
def test_a_malformed_config_names_what_is_wrong(ab: ModuleType, spec: str) -> None:
    with pytest.raises(ValueError, match="--config"):
        ab.parse_config(spec)


def test_each_trial_is_divided_by_the_base_trial_of_its_round(ab: ModuleType) -> None:
    results = {"a": [100.0, 200.0], "b": [110.0, 180.0]}
    ratios = ab.trial_ratios(results, "a")
    assert ratios["a"] == [1.0, 1.0]
    assert ratios["b"] == pytest.approx([1.1, 0.9])
    with pytest.raises(ValueError):  # a missing trial is an error, not a shifted pairing
        ab.trial_ratios({"a": [1.0, 2.0], "b": [1.0]}, "a")


def test_the_order_alternates_between_rounds(ab: ModuleType) -> None:
    labels = ["a", "b", "c"]
    assert [ab.order_for_round(labels, r) for r in range(3)] == [labels, labels[::-1], labels]


def test_the_peer_ratio_is_the_first_configuration_over_the_peer_by_pairs(ab: ModuleType) -> None:
    results = {"sluice": [200.0, 150.0, 210.0], ab.LLAMA: [100.0, 100.0, 70.0]}
    assert ab.inverse_ratios(results, "sluice", ab.LLAMA) == [2.0, 1.5, 3.0]


def test_waiting_for_a_quiet_machine_is_bounded(ab: ModuleType) -> None:
    assert ab.wait_quiet(idle_share=0.0, window_s=0.01, max_s=5.0) < 5.0  # any window will do
    waited = ab.wait_quiet(idle_share=1.01, window_s=0.01, max_s=0.05)  # none will
    assert 0.05 <= waited < 5.0


def test_the_engine_worker_answers_each_trial_with_its_tokens_and_seconds(ab: ModuleType) -> None:
    """The worker's loop on a stand-in Engine: one result line per trial line, in order, with
    the requests that ended short counted."""
    import io
    import json

    class FakeEngine:
        def __init__(self) -> None:
            self.calls: list[tuple[list, dict]] = []

        def generate(self, input_ids, sampling_params):
            self.calls.append((input_ids, sampling_params))
            n = sampling_params["max_new_tokens"]
            return [{"meta_info": {"completion_tokens": n - (p == [9])}} for p in input_ids]

    engine, out = FakeEngine(), io.StringIO()
    trials = [{"prompts": [[1, 2], [3]], "output_len": 5}, {"prompts": [[9]], "output_len": 4}]
    ab.serve_trials(engine, [json.dumps(t) + "\n" for t in trials], out)
    results = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["tokens"], r["wrong"]) for r in results] == [(10, 0), (3, 1)]
    assert all(r["seconds"] >= 0 for r in results)
    assert engine.calls[0] == (
        [[1, 2], [3]],
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": 5},
    )


def test_a_pythonpath_tree_is_the_sluice_a_server_runs_even_from_this_checkout(
    ab: ModuleType, tmp_path, monkeypatch
) -> None:
    """A configuration's PYTHONPATH (another checkout) must win over the current directory,
    which `python -m` would otherwise put first: the servers of an A/B started from this
    checkout then ran this checkout's code on both sides."""
    other = tmp_path / "other-checkout"
    (other / "sluice").mkdir(parents=True)
    (other / "sluice" / "__init__.py").write_text("")
    (other / "sluice" / "__main__.py").write_text("import sys; print(__file__); sys.exit(3)\n")
    checkout = Path(__file__).parents[2]
    monkeypatch.chdir(checkout)
    env = {**os.environ, "PYTHONPATH": str(other)}
    assert ab.sluice_origin(env) == str(other / "sluice")
    run = subprocess.run(
        ab.sluice_command(0, []), env=env, cwd=checkout, capture_output=True, text=True
    )
    assert run.returncode == 3 and run.stdout.strip() == str(other / "sluice" / "__main__.py")
    assert ab.sluice_origin({**os.environ, "PYTHONPATH": ""}) == str(checkout / "sluice")


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_the_other_members_are_stopped_during_a_trial_and_continued_after(ab: ModuleType) -> None:
    """A server's whole process group (here a shell and its child) and the Engine worker's one
    process are stopped (state T) inside `others_stopped` and running after it, an error
    inside included."""
    server = ab.ServerProcess("s", ["true"], "http://127.0.0.1:1", "/health")
    server.proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    engine = ab.EngineMember()
    engine.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        for _ in range(50):  # the shell's child, once it has started
            children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children")
            if children.read_text().split():
                break
            time.sleep(0.05)
        child = int(children.read_text().split()[0])
        pids = [server.proc.pid, child, engine.proc.pid]
        with pytest.raises(RuntimeError, match="trial failed"):
            with ab.others_stopped([server, engine]):
                time.sleep(0.1)
                assert [_state(p) for p in pids] == ["T", "T", "T"]
                raise RuntimeError("trial failed")
        time.sleep(0.1)
        assert "T" not in [_state(p) for p in pids]
    finally:
        os.killpg(server.proc.pid, signal.SIGKILL)
        engine.proc.kill()
        server.proc.wait()
        engine.proc.wait()


def test_ttft_p99s_are_paired_with_the_base_and_the_peer_over_the_base(
    ab: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    ttfts = {"new": [1.0, 2.0], "old": [2.0, 3.0], ab.VLLM: [4.0, 2.0]}
    ab.print_ttfts(ttfts, "new", [ab.VLLM, ab.ENGINE])  # the Engine has no TTFTs: left out
    out = capsys.readouterr().out
    assert (
        "old              TTFT p99 median  2.500 s; / new: median 1.750 (min 1.500, max 2.000)"
        in out
    )
    assert f"new / {ab.VLLM} TTFT p99: median 0.625 (min 0.250, max 1.000) by pairs" in out
    assert ab.ENGINE not in out
    ab.print_ttfts({ab.VLLM: [1.0]}, "new", [ab.VLLM])  # no HTTP base: nothing to pair with
    assert capsys.readouterr().out == ""
