"""xgrammar against llguidance on this machine, with the default model's tokenizer.

Over `tests/data/grammar_corpus.json` (JSON schemas, regexes, Lark grammars), in one process:
  - cold compile time per grammar, nothing reused between grammars: xgrammar compiles with a
    fresh `GrammarCompiler(..., cache_enabled=False)` each time; llguidance builds an `LLMatcher`
    from the grammar text ("construct"; it compiles lazily), then also fills its first mask
    ("+first mask"), the point where both engines are ready to decode;
  - the entries each engine rejects or fails on (its grammar errors, or the example instance
    not accepted): Lark grammars are tested on llguidance only;
  - mask time per decode step at batch 32: 32 matchers of JSON schemas accepted by both, each
    advanced along the tokens of its example instance (then EOS, then from the start again), the
    [32, ceil(V / 32)] int32 bitmask filled for all 32 each step, parallel and serial;
  - applying that bitmask to float32 logits [32, V] on CPU: plain torch against xgrammar's kernel.

An engine failing on one grammar is counted and named, never a crash. Timings are wall-clock ms;
compare the two engines of one run, not figures across runs.

    .venv/bin/python benchmarks/grammar_backends.py [--steps 128] [--threads 2] [--model PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "grammar_corpus.json"
BATCH = 32
VOCAB = 49152  # SmolLM2's lm_head rows
BITS = 32  # tokens per int32 bitmask word
APPLY_ITERS = 50
SHIFTS = torch.arange(BITS, dtype=torch.int32)


# ----------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Entry:
    kind: str  # "json" | "regex" | "lark"
    name: str
    text: str  # the schema as JSON text, the regex, or the Lark grammar
    example: str  # a string the grammar must accept in full


def load_corpus(path: Path) -> list[Entry]:
    data = json.loads(path.read_text())
    entries = [
        Entry("json", e["name"], json.dumps(e["schema"]), json.dumps(e["example"]))
        for e in data["json_schemas"]
    ]
    entries += [Entry("regex", e["name"], e["regex"], e["example"]) for e in data["regexes"]]
    entries += [Entry("lark", e["name"], e["grammar"], e["example"]) for e in data["lark"]]
    return entries


# ----------------------------------------------------------------------------- statistics


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; q in [0, 100]."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


@dataclass
class CompileResult:
    """Per-phase timings (ms) by entry kind, and the entries that failed with why."""

    times: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)
    tested: int = 0

    def add(self, phase: str, kind: str, ms: float) -> None:
        self.times.setdefault(phase, {}).setdefault(kind, []).append(ms)


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """The lines written to file descriptor 2 inside the block, kept off the terminal (xgrammar
    logs its warnings from C++, past `sys.stderr`)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(ln.strip() for ln in tmp.read().splitlines() if ln.strip())


def one_line(err: Any) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:110]


# ----------------------------------------------------------------------------- llguidance


class Llguidance:
    """Matchers over one shared `LLTokenizer` (its cost is the tokenizer's, paid once)."""

    name = "llguidance"

    def __init__(self, hf_tok: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf_tok)
        self.setup_ms = ms_since(t0)

    def grammar(self, entry: Entry) -> str:
        m = self.ll.LLMatcher
        if entry.kind == "json":
            return m.grammar_from_json_schema(entry.text)
        return (
            m.grammar_from_regex(entry.text)
            if entry.kind == "regex"
            else m.grammar_from_lark(entry.text)
        )

    def matcher(self, entry: Entry) -> Any:
        """A matcher for `entry`; raises with llguidance's message if the grammar is an error
        (the constructor itself never raises: it leaves the matcher in the error state)."""
        m = self.ll.LLMatcher(self.tok, self.grammar(entry), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.ll.torch.fill_next_token_bitmask(m, bitmask, row)
        if m.is_error():
            raise ValueError(m.get_error())

    def accepts(self, m: Any, ids: list[int]) -> str:
        if not m.consume_tokens(ids):
            return "example rejected: " + one_line(m.get_error())
        return "" if m.is_accepting() else "example accepted but not complete"

    def consume(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def reset(self, m: Any) -> None:
        m.reset()


def time_llguidance(
    eng: Llguidance, entries: list[Entry], ids: dict[str, list[int]]
) -> CompileResult:
    """Cold construct, and construct + first mask, per entry; then the example checked."""
    res = CompileResult(tested=len(entries))
    bitmask = torch.full((1, math.ceil(VOCAB / BITS)), -1, dtype=torch.int32)
    for e in entries:
        try:
            t0 = time.perf_counter()
            m = eng.matcher(e)
            res.add("construct", e.kind, ms_since(t0))
            eng.fill(m, bitmask, 0)
            res.add("construct+first mask", e.kind, ms_since(t0))
            res.warnings += [(f"{e.kind}:{e.name}", one_line(w)) for w in m.get_grammar_warnings()]
            problem = eng.accepts(m, ids[e.kind + ":" + e.name])
        except Exception as err:  # an engine failure is a finding, not a crash
            problem = one_line(err)
        if problem:
            res.failures.append((f"{e.kind}:{e.name}", problem))
    return res


# ----------------------------------------------------------------------------- xgrammar


class Xgrammar:
    """Compiled grammars over one shared `TokenizerInfo`; a fresh compiler per compile. The
    grammars of the compile pass are kept for the decode steps (which measure masks, not compiles).
    """

    name = "xgrammar"

    def __init__(self, hf_tok: Any) -> None:
        import xgrammar

        self.xg = xgrammar
        t0 = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=VOCAB)
        self.setup_ms = ms_since(t0)
        self.compiled: dict[Entry, Any] = {}

    def compile(self, entry: Entry) -> Any:
        compiler = self.xg.GrammarCompiler(self.info, cache_enabled=False)
        t0 = time.perf_counter()
        if entry.kind == "json":
            compiled = compiler.compile_json_schema(entry.text)
        elif entry.kind == "regex":
            compiled = compiler.compile_regex(entry.text)
        else:
            raise ValueError("Lark grammars are not tested on xgrammar")
        elapsed = ms_since(t0)
        self.compiled[entry] = compiled
        return compiled, elapsed

    def matcher(self, entry: Entry) -> Any:
        compiled = self.compiled.get(entry) or self.compile(entry)[0]
        return self.xg.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accepts(self, m: Any, ids: list[int]) -> str:
        for i, t in enumerate(ids):
            if not m.accept_token(t):
                return f"example rejected at token {i} of {len(ids)}"
        return "" if m.is_completed() else "example accepted but not complete"

    def consume(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def reset(self, m: Any) -> None:
        m.reset()


def time_xgrammar(eng: Xgrammar, entries: list[Entry], ids: dict[str, list[int]]) -> CompileResult:
    """Cold compile, and compile + matcher + first mask, per entry; then the example checked."""
    res = CompileResult(tested=len(entries))
    bitmask = torch.full((1, math.ceil(VOCAB / BITS)), -1, dtype=torch.int32)
    for e in entries:
        try:
            with captured_stderr() as logged:
                compiled, compile_ms = eng.compile(e)
            res.warnings += [(f"{e.kind}:{e.name}", ln) for ln in logged]
            t0 = time.perf_counter()
            m = eng.xg.GrammarMatcher(compiled)
            eng.fill(m, bitmask, 0)
            res.add("compile", e.kind, compile_ms)
            res.add("compile+first mask", e.kind, compile_ms + ms_since(t0))
            problem = eng.accepts(m, ids[e.kind + ":" + e.name])
        except Exception as err:  # an engine failure is a finding, not a crash
            problem = one_line(err)
        if problem:
            res.failures.append((f"{e.kind}:{e.name}", problem))
    return res


# ----------------------------------------------------------------------------- decode steps


@dataclass
class StepResult:
    fill_ms: list[float] = field(default_factory=list)
    consume_ms: list[float] = field(default_factory=list)
    allowed: list[float] = field(default_factory=list)  # mean allowed tokens per row, per step
    rejected: int = 0  # tokens a matcher refused (should be 0)
    error: str = ""
    sample_mask: torch.Tensor | None = None  # a filled bitmask from mid-run, for the apply test


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, W] int32 words to a [B, vocab] bool mask, bit j of word w being token 32 * w + j."""
    bits = (bitmask.unsqueeze(-1) >> SHIFTS) & 1  # [B, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def run_steps(eng: Any, entries: list[Entry], seqs: list[list[int]], eos: int, steps: int,
              fill_all: Callable[[list[Any], torch.Tensor], None]) -> StepResult:  # fmt: skip
    """`steps` decode steps over one matcher per entry: fill all masks (timed), then each matcher
    consumes its next token; a matcher past its example consumes EOS and starts over."""
    res = StepResult()
    try:
        matchers = [eng.matcher(e) for e in entries]
    except Exception as err:
        res.error = one_line(err)
        return res
    pos = [0] * len(matchers)
    bitmask = torch.full((len(matchers), math.ceil(VOCAB / BITS)), -1, dtype=torch.int32)
    fill_all(matchers, bitmask)  # warm-up at the initial state, untimed
    for step in range(steps):
        t0 = time.perf_counter()
        try:
            fill_all(matchers, bitmask)
        except Exception as err:
            res.error = one_line(err)
            return res
        res.fill_ms.append(ms_since(t0))
        res.allowed.append(unpack(bitmask, VOCAB).sum().item() / len(matchers))
        if step == steps // 2:
            res.sample_mask = bitmask.clone()
        t0 = time.perf_counter()
        advance(eng, matchers, seqs, pos, eos, res)
        res.consume_ms.append(ms_since(t0))
    return res


def advance(eng: Any, matchers: list[Any], seqs: list[list[int]], pos: list[int], eos: int,
            res: StepResult) -> None:  # fmt: skip
    for i, m in enumerate(matchers):
        token = seqs[i][pos[i]] if pos[i] < len(seqs[i]) else eos
        if not eng.consume(m, token):
            res.rejected += 1
        pos[i] += 1
        if token == eos:
            eng.reset(m)
            pos[i] = 0


def step_variants(ll: Llguidance, xg: Xgrammar, threads: int) -> list[tuple[Any, str, Callable]]:
    batch = xg.xg.BatchGrammarMatcher(max_threads=threads)

    def par(executor: Any) -> Callable:
        fill_par = ll.ll.torch.fill_next_token_bitmask_par
        return lambda ms, bm: fill_par(executor, [(m, i) for i, m in enumerate(ms)], bm)

    ll_par = par(ll.ll.LLExecutor(num_threads=threads))

    def serial(eng: Any) -> Callable:
        return lambda ms, bm: [eng.fill(m, bm, i) for i, m in enumerate(ms)]

    variants = [
        (ll, f"fill_next_token_bitmask_par ({threads} thr)", ll_par),
        (ll, "fill_next_token_bitmask, serial", serial(ll)),
        (xg, f"BatchGrammarMatcher ({threads} thr)", batch.batch_fill_next_token_bitmask),
        (xg, "GrammarMatcher loop, serial", serial(xg)),
    ]
    if threads > 1:  # what the thread pools cost: the same calls on one thread
        variants[1:1] = [(ll, "fill_next_token_bitmask_par (1 thr)", par(ll.ll.LLExecutor(1)))]
        batch1 = xg.xg.BatchGrammarMatcher(max_threads=1)
        variants.insert(
            -1, (xg, "BatchGrammarMatcher (1 thr)", batch1.batch_fill_next_token_bitmask)
        )
    return variants


# ----------------------------------------------------------------------------- applying masks


def apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    logits.masked_fill_(~unpack(bitmask, logits.shape[1]), float("-inf"))


def time_apply(fn: Callable[[torch.Tensor, torch.Tensor], None], bitmask: torch.Tensor) -> tuple[list[float], torch.Tensor]:  # fmt: skip
    """ms per call of `fn(logits, bitmask)` on fresh float32 logits [B, V]; the last result."""
    base = torch.randn(bitmask.shape[0], VOCAB, generator=torch.Generator().manual_seed(0))
    logits = base.clone()
    fn(logits, bitmask)  # warm-up
    times = []
    for _ in range(APPLY_ITERS):
        logits.copy_(base)
        t0 = time.perf_counter()
        fn(logits, bitmask)
        times.append(ms_since(t0))
    return times, logits


# ----------------------------------------------------------------------------- report


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (lscpu failed)"
    lines = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
    return lines[0] if lines else "unknown"


def stat_row(label: str, xs: list[float]) -> str:
    if not xs:
        return f"  {label:<46} {'-':>4}"
    p50, p99 = percentile(xs, 50), percentile(xs, 99)
    return f"  {label:<46} {len(xs):>4} {p50:>8.2f} {p99:>8.2f} {max(xs):>8.2f} {sum(xs):>9.1f}"


def print_compile(results: list[tuple[str, CompileResult]]) -> None:
    print("\n== cold compile per grammar (ms; nothing reused between grammars) ==")
    print(f"  {'engine / phase / kind':<46} {'n':>4} {'p50':>8} {'p99':>8} {'max':>8} {'total':>9}")
    for engine, res in results:
        for phase, by_kind in res.times.items():
            everything = [t for ts in by_kind.values() for t in ts]
            print(stat_row(f"{engine} {phase}, all", everything))
            for kind, ts in by_kind.items():
                print(stat_row(f"{engine} {phase}, {kind}", ts))


def total_of(res: CompileResult, phase: str, kinds: tuple[str, ...]) -> float:
    return sum(sum(ts) for k, ts in res.times.get(phase, {}).items() if k in kinds)


def print_failures(results: list[tuple[str, CompileResult]]) -> None:
    print("\n== corpus entries rejected or failed (grammar error, or example not accepted) ==")
    scope = {"xgrammar": "JSON schemas + regexes; Lark grammars are not tested on xgrammar",
             "llguidance": "JSON schemas + regexes + Lark grammars"}  # fmt: skip
    for engine, res in results:
        print(f"  {engine} ({scope[engine]}): {len(res.failures)} of {res.tested}")
        for name, why in res.failures:
            print(f"    {name}: {why}")
    print("  grammar warnings (compiled, but the engine said it relaxes or ignores something):")
    for engine, res in results:
        print(f"  {engine}: {len(res.warnings)}")
        for name, why in res.warnings:
            print(f"    {name}: {why.split('] ', 1)[-1]}")


def print_steps(rows: list[tuple[str, str, StepResult]], steps: int) -> None:
    print(f"\n== mask fill per decode step, batch {BATCH} ({steps} steps; JSON-schema matchers "
          "advanced along their examples) ==")  # fmt: skip
    head = f"  {'engine':<11} {'fill':<34} {'mean ms':>8} {'p50 ms':>7} {'p99 ms':>7} {'ms/row':>7}"
    print(head + f" {'consume ms':>10} {'allowed/row':>11} {'refused':>7}")
    for engine, label, r in rows:
        if r.error or not r.fill_ms:
            print(f"  {engine:<11} {label:<34} FAILED: {r.error}")
            continue
        mean = sum(r.fill_ms) / len(r.fill_ms)
        p50, p99 = percentile(r.fill_ms, 50), percentile(r.fill_ms, 99)
        line = f"  {engine:<11} {label:<34} {mean:>8.3f} {p50:>7.3f} {p99:>7.3f}"
        consume = sum(r.consume_ms) / len(r.consume_ms)
        allowed = sum(r.allowed) / len(r.allowed)
        print(line + f" {mean / BATCH:>7.4f} {consume:>10.3f} {allowed:>11.0f} {r.rejected:>7}")


def print_apply(rows: list[tuple[str, list[float]]], same: bool | None) -> None:
    print(f"\n== applying a [{BATCH}, {VOCAB}] int32 bitmask to float32 logits, CPU "
          f"({APPLY_ITERS} calls) ==")  # fmt: skip
    print(f"  {'implementation':<50} {'mean ms':>8} {'p50 ms':>7} {'p99 ms':>7}")
    for label, ts in rows:
        if not ts:
            print(f"  {label:<50} FAILED")
            continue
        mean, p50, p99 = sum(ts) / len(ts), percentile(ts, 50), percentile(ts, 99)
        print(f"  {label:<50} {mean:>8.3f} {p50:>7.3f} {p99:>7.3f}")
    if same is not None:
        print(f"  same -inf positions in both: {same}")


# ----------------------------------------------------------------------------- main


def pick_batch(entries: list[Entry], failed: set[str]) -> list[Entry]:
    """BATCH JSON schemas accepted by both engines, in corpus order (repeated if too few)."""
    ok = [e for e in entries if e.kind == "json" and f"json:{e.name}" not in failed]
    return [ok[i % len(ok)] for i in range(BATCH)] if ok else []


def warm_up(ll: Llguidance, xg: Xgrammar) -> None:
    """One throwaway grammar per engine, so one-time library set-up is not charged to the first."""
    warm = Entry("regex", "warm-up", "[a-z]{1,4}", "ab")
    bitmask = torch.full((1, math.ceil(VOCAB / BITS)), -1, dtype=torch.int32)
    ll.fill(ll.matcher(warm), bitmask, 0)
    xg.fill(xg.matcher(warm), bitmask, 0)


def measure_steps(ll: Llguidance, xg: Xgrammar, batch: list[Entry], tok: Any, args: Any) -> list:
    if not batch:
        print("\n(no JSON schema accepted by both engines: decode steps skipped)")
        return []
    seqs = [tok.encode(e.example, add_special_tokens=False) for e in batch]
    rows = []
    for eng, label, fill_all in step_variants(ll, xg, args.threads):
        rows.append(
            (eng.name, label, run_steps(eng, batch, seqs, tok.eos_token_id, args.steps, fill_all))
        )
    return rows


def measure_apply(mask: torch.Tensor | None) -> tuple[list[tuple[str, list[float]]], bool | None]:
    import xgrammar

    if mask is None:  # no decode run filled one: a synthetic half-allowed mask
        mask = torch.randint(
            -(2**31), 2**31 - 1, (BATCH, math.ceil(VOCAB / BITS)), dtype=torch.int32
        )
    t_torch, out_torch = time_apply(apply_torch, mask)
    try:
        xg_fn = lambda lg, bm: xgrammar.apply_token_bitmask_inplace(lg, bm, vocab_size=VOCAB)  # noqa: E731
        t_xg, out_xg = time_apply(xg_fn, mask)
        same = bool(torch.equal(out_torch.isinf(), out_xg.isinf()))
    except Exception as err:
        print(f"  xgrammar.apply_token_bitmask_inplace failed: {one_line(err)}")
        t_xg, same = [], None
    rows = [("torch: shift-unpack to bool + masked_fill_", t_torch),
            ("xgrammar.apply_token_bitmask_inplace (cpu backend)", t_xg)]  # fmt: skip
    return rows, same


def load_tokenizer(model: str | None) -> tuple[Any, str]:
    from sluice.checkpoint.hf_dir import prepare_hf_dir, resolve_model_path
    from sluice.utils.tokenizer import get_tokenizer

    hf_dir = prepare_hf_dir(resolve_model_path(model))
    return get_tokenizer(hf_dir), hf_dir


def print_header(
    ll: Llguidance, xg: Xgrammar, hf_dir: str, entries: list[Entry], threads: int
) -> None:
    version = importlib.metadata.version
    print(
        f"CPU: {cpu_model()}; torch threads: {torch.get_num_threads()}; engine threads: {threads}"
    )
    print(
        f"xgrammar {version('xgrammar')}, llguidance {version('llguidance')}, torch {torch.__version__}"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"tokenizer: {hf_dir} (vocab {VOCAB}); load average {load} (compare runs on a quiet machine)"
    )
    counts = {k: sum(e.kind == k for e in entries) for k in ("json", "regex", "lark")}
    print(
        f"corpus: {counts['json']} JSON schemas, {counts['regex']} regexes, {counts['lark']} Lark grammars"
    )
    print(f"one-time tokenizer set-up: xgrammar TokenizerInfo {xg.setup_ms:.0f} ms, "
          f"llguidance LLTokenizer {ll.setup_ms:.0f} ms (not in the compile times)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)")
    ap.add_argument("--steps", type=int, default=128, help="decode steps at batch 32")
    ap.add_argument("--threads", type=int, default=2, help="torch and engine threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    tok, hf_dir = load_tokenizer(args.model)
    entries = load_corpus(args.corpus)
    ids = {f"{e.kind}:{e.name}": tok.encode(e.example, add_special_tokens=False) for e in entries}
    ll, xg = Llguidance(tok), Xgrammar(tok)
    print_header(ll, xg, hf_dir, entries, args.threads)
    warm_up(ll, xg)

    res_xg = time_xgrammar(xg, [e for e in entries if e.kind != "lark"], ids)
    res_ll = time_llguidance(ll, entries, ids)
    results = [("xgrammar", res_xg), ("llguidance", res_ll)]
    print_compile(results)
    json_regex = ("json", "regex")
    ratio = total_of(res_ll, "construct+first mask", json_regex) / max(
        total_of(res_xg, "compile", json_regex), 1e-9
    )
    print(
        f"  ratio llguidance construct+first mask / xgrammar compile, JSON+regex totals: {ratio:.3f}"
    )
    print_failures(results)

    failed = {n for _, r in results for n, _ in r.failures}
    step_rows = measure_steps(ll, xg, pick_batch(entries, failed), tok, args)
    print_steps(step_rows, args.steps)
    mask = next((r.sample_mask for _, _, r in step_rows if r.sample_mask is not None), None)
    print_apply(*measure_apply(mask))
    print(f"\ntotal run time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
