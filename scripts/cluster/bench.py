#!/usr/bin/env python3
"""N wick replicas behind vllm-router on loopback, one shared --ssd-cache directory, and an
agent-like load: conversations of several turns, many sharing a system prompt. For each
routing policy the replicas and the router start fresh, the load runs, and the script prints
(and writes as JSON) the prefix-hit rate, TTFT p50/p99 and throughput. With --kill-at a
replica is killed mid-run and restarted; with --add-at a new replica joins through the
router's /add_worker. Standard library only; the router comes from scripts/cluster/setup.sh.

  scripts/cluster/bench.py --replicas 4 --policies cache_aware,round_robin \
      --conversations 32 --turns 6 --out target/cluster/results.json
  scripts/cluster/bench.py --policies cache_aware --kill-at 0.4 --add-at 0.6
"""
import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def http_json(url: str, method: str = "GET", body=None, key: str | None = None, timeout=10.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def wait_health(url: str, timeout: float, proc=None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


class Replica:
    """One `wick serve` process on a fixed port (a restart reuses the port, as a router expects)."""

    def __init__(self, args, index: int, ssd: Path, logs: Path):
        self.args, self.index, self.ssd, self.logs = args, index, ssd, logs
        self.port = args.port_base + 1 + index
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.proc = None
        self.starts = 0

    def start(self):
        self.starts += 1
        cmd = [str(self.args.wick), "serve", self.args.model, "--host", LOOPBACK,
               "--port", str(self.port), "--ssd-cache", str(self.ssd),
               "--ssd-write-max-defer", str(self.args.write_max_defer),
               "--max-batch", str(self.args.max_batch), "--kv-memory", self.args.kv_memory]
        if self.args.api_key:
            cmd += ["--api-key", self.args.api_key]
        env = dict(os.environ, WICK_THREADS=str(self.args.threads), WICK_LOG="info")
        out = open(self.logs / f"{self.ssd.parent.name}-replica{self.index}.{self.starts}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        if not wait_health(self.url, 180, self.proc):
            raise RuntimeError(f"replica {self.index} did not start; see {out.name}")

    def kill(self, sig: int):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stats(self) -> dict | None:
        try:
            return http_json(self.url + "/stats", key=self.args.api_key)
        except OSError:
            return None


class Router:
    def __init__(self, args, policy: str, workers: list[str], logs: Path, name: str):
        self.url = f"http://{LOOPBACK}:{args.port_base}"
        venv = Path(args.router_venv)
        cmd = [str(venv / "bin" / "vllm-router"), "--host", LOOPBACK, "--port", str(args.port_base),
               "--policy", policy, "--worker-urls", *workers,
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--health-success-threshold", "1", "--retry-max-retries", "5",
               "--retry-initial-backoff-ms", "200", "--retry-max-backoff-ms", "2000",
               "--request-timeout-secs", "600", "--log-level", "info", *args.router_arg]
        self.out = open(logs / f"router-{name}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT)
        if not wait_health(self.url, 120, self.proc):
            raise RuntimeError(f"the router did not start; see {self.out.name}")

    def add_worker(self, url: str):
        req = urllib.request.Request(f"{self.url}/add_worker?url={url}", method="POST")
        with urllib.request.urlopen(req, timeout=200) as r:
            return r.status

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# --- the workload ---------------------------------------------------------------------------

TOPICS = ["inventory", "billing", "deployments", "incident triage", "code review", "hiring",
          "travel", "security audits"]


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(1000 + i)
    topic = TOPICS[i % len(TOPICS)]
    facts = " ".join(f"Fact {k}: item {rng.randrange(1000)} of {topic} is in state "
                     f"{rng.choice(['open', 'closed', 'pending', 'blocked'])}."
                     for k in range(words // 10))
    return f"You are an agent that handles {topic}. Use the tool results below. {facts}"


def user_turn(conv: int, turn: int, words: int = 40) -> str:
    """A turn of an agent loop: a tool result of its own (about `words` words) and the next ask."""
    rng = random.Random(conv * 1000 + turn)
    result = " ".join(f"row {rng.randrange(10000)}={rng.choice(['ok', 'late', 'lost', 'held'])};"
                      for _ in range(words // 2))
    return (f"Tool result for task {conv}, step {turn}: {result} "
            f"Next: check item {(conv * 31 + turn * 7) % 1000} and report in one line.")


# The conversations of the run in progress (read by the probe of an added replica).
LIVE: dict = {}


class Conversation:
    def __init__(self, i: int, args, systems: list[str]):
        self.i = i
        self.messages = [{"role": "system", "content": systems[i % len(systems)]}]
        self.turns_done = 0
        self.failed = False


def stream_turn(base: str, conv: Conversation, args) -> dict:
    """One streamed chat turn; returns timings and usage. Raises on any failure."""
    body = {"model": "default", "messages": conv.messages + [
        {"role": "user", "content": user_turn(conv.i, conv.turns_done, args.tool_words)}],
        "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
    host, port = base.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    ttft, text, usage, finished = None, [], None, False
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            finished = True
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.monotonic() - t0
                text.append(piece)
    c.close()
    if not finished or usage is None:
        raise RuntimeError("stream ended early")
    total = time.monotonic() - t0
    conv.messages = body["messages"] + [{"role": "assistant", "content": "".join(text)}]
    details = usage.get("prompt_tokens_details") or {}
    return {"conv": conv.i, "turn": conv.turns_done, "ttft": ttft if ttft is not None else total,
            "latency": total, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens", 0),
            "completion_tokens": usage["completion_tokens"], "end": time.monotonic()}


def run_load(base: str, args, on_progress) -> dict:
    systems = [system_prompt(i, args.system_words) for i in range(args.system_prompts)]
    convs = [Conversation(i, args, systems) for i in range(args.conversations)]
    LIVE["convs"] = convs
    total_turns = args.conversations * args.turns
    results, errors = [], []
    lock = threading.Lock()
    work = [c for c in convs]
    rng = random.Random(7)

    def worker():
        while True:
            with lock:
                ready = [c for c in work if not c.failed and c.turns_done < args.turns]
                if not ready:
                    return
                conv = rng.choice(ready)
                work.remove(conv)  # one turn of a conversation at a time
            for attempt in range(args.client_retries + 1):
                try:
                    res = stream_turn(base, conv, args)
                    break
                except Exception as e:  # noqa: BLE001 (any failure is counted)
                    with lock:
                        errors.append({"conv": conv.i, "turn": conv.turns_done, "attempt": attempt,
                                       "error": str(e)[:200], "at": time.monotonic()})
                    time.sleep(0.5)
            else:
                res = None
            with lock:
                if res is None:
                    conv.failed = True
                else:
                    res["attempts"] = attempt + 1
                    results.append(res)
                    conv.turns_done += 1
                work.append(conv)
                done = len(results)
            on_progress(done / total_turns)

    started = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    return {"results": results, "errors": errors, "wall_s": wall, "started": started,
            "failed_conversations": [c.i for c in convs if c.failed or c.turns_done < args.turns]}


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def summarize(policy: str, load: dict, chaos: dict) -> dict:
    res = load["results"]
    later = [r for r in res if r["turn"] > 0]
    prompt = sum(r["prompt_tokens"] for r in res)
    cached = sum(r["cached_tokens"] for r in res)
    ttfts = [r["ttft"] for r in res]
    out = {
        "policy": policy,
        "requests": len(res),
        "prefix_hit_rate_tokens": round(cached / prompt, 3) if prompt else 0,
        "continuation_turns_with_hit": round(sum(r["cached_tokens"] > 0 for r in later) / len(later), 3)
        if later else 0,
        "ttft_p50_s": round(pct(ttfts, 50), 3),
        "ttft_p99_s": round(pct(ttfts, 99), 3),
        "completion_tok_per_s": round(sum(r["completion_tokens"] for r in res) / load["wall_s"], 2),
        "requests_per_s": round(len(res) / load["wall_s"], 3),
        "wall_s": round(load["wall_s"], 1),
        "client_errors": len(load["errors"]),
        "turns_retried_by_client": sum(r["attempts"] > 1 for r in res),
        "failed_conversations": load["failed_conversations"],
    }
    if chaos:
        out["chaos"] = chaos
        if "killed_at" in chaos:
            after = [r for r in later if r["end"] - load["started"] > chaos["killed_at"]]
            out["chaos"]["continuation_turns_after_kill"] = len(after)
            out["chaos"]["continuation_turns_after_kill_with_hit"] = round(
                sum(r["cached_tokens"] > 0 for r in after) / len(after), 3) if after else None
    return out


def bench_policy(args, spec: str, logs: Path) -> dict:
    # `policy` or `policy:private` (each replica its own SSD directory, nothing shared).
    policy, _, sharing = spec.partition(":")
    private = sharing == "private"
    ssd = Path(tempfile.mkdtemp(prefix=f"ssd-{policy}-", dir=args.work))
    replicas = [Replica(args, i, ssd / (f"r{i}" if private else "shared"), logs)
                for i in range(args.replicas)]
    extra = (Replica(args, args.replicas, ssd / (f"r{args.replicas}" if private else "shared"), logs)
             if args.add_at is not None else None)
    router = None
    chaos, timers = {}, []
    try:
        for r in replicas:
            r.start()
        router = Router(args, policy, [r.url for r in replicas], logs, spec.replace(":", "-"))
        log(f"{policy}: {len(replicas)} replicas and the router are up")
        state = {"killed": False, "added": False}
        t_start = time.monotonic()

        def restart(victim):
            try:
                victim.start()
                chaos["restarted_at"] = round(time.monotonic() - t_start, 2)
                log(f"replica {victim.index} restarted")
            except Exception as e:  # noqa: BLE001
                chaos["restart_error"] = str(e)

        def add():
            try:
                extra.start()
                # Its very first request, sent to it directly: the next turn of conversations
                # it never saw (copies; the conversations themselves go on through the router).
                probes = []
                for conv in [c for c in LIVE["convs"] if c.turns_done >= 2][:3]:
                    copy = Conversation(conv.i, args, [conv.messages[0]["content"]])
                    copy.messages, copy.turns_done = list(conv.messages), conv.turns_done
                    r = stream_turn(extra.url, copy, args)
                    probes.append({"prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"],
                                   "ttft_s": round(r["ttft"], 3)})
                chaos["added_replica_first_requests"] = probes
                router.add_worker(extra.url)
                chaos["added_at"] = round(time.monotonic() - t_start, 2)
                log(f"replica {extra.index} added; its first requests: {probes}")
            except Exception as e:  # noqa: BLE001
                chaos["add_error"] = str(e)

        def progress(frac):
            if args.kill_at is not None and frac >= args.kill_at and not state["killed"]:
                state["killed"] = True
                victim = replicas[args.kill_index]
                sig = signal.SIGKILL if args.kill_signal == "KILL" else signal.SIGTERM
                chaos["killed_at"] = round(time.monotonic() - t_start, 2)
                chaos["killed"] = victim.url
                chaos["signal"] = args.kill_signal
                log(f"killing replica {victim.index} ({args.kill_signal}) at {frac:.0%}")
                threading.Thread(target=victim.kill, args=(sig,)).start()
                t = threading.Timer(args.restart_after, restart, args=(victim,))
                t.start()
                timers.append(t)
            if extra is not None and frac >= args.add_at and not state["added"]:
                state["added"] = True
                t = threading.Thread(target=add)
                t.start()
                timers.append(t)

        load = run_load(router.url, args, progress)
        for t in timers:
            t.join()
        per_replica = {}
        for r in replicas + ([extra] if extra else []):
            s = r.stats()
            if s:
                pc = s["prompt_cache"]
                per_replica[r.url] = {"starts": r.starts, "hits": pc["hits"], "misses": pc["misses"],
                                      "ram_hits": pc["ram_hits"], "ssd_hits": pc["ssd_hits"],
                                      "completed": s["requests"]["completed"],
                                      "failed": s["requests"]["failed"]}
        if "killed" in chaos and chaos["killed"] in per_replica:
            p = per_replica[chaos["killed"]]
            n = p["hits"] + p["misses"]
            chaos["restarted_replica_requests"] = n
            chaos["restarted_replica_hit_fraction"] = round(p["hits"] / n, 3) if n else None
            chaos["restarted_replica_ssd_restores"] = p["ssd_hits"]
        if extra is not None and extra.url in per_replica:
            p = per_replica[extra.url]
            n = p["hits"] + p["misses"]
            chaos["added_replica_requests"] = n
            chaos["added_replica_hit_fraction"] = round(p["hits"] / n, 3) if n else None
            chaos["added_replica_ssd_restores"] = p["ssd_hits"]
        out = summarize(spec, load, chaos)
        out["per_replica"] = per_replica
        out["errors"] = load["errors"][:20]
        return out
    finally:
        if router:
            router.stop()
        for r in replicas + ([extra] if extra else []):
            r.kill(signal.SIGTERM)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--policies", default="cache_aware,round_robin",
                    help="router policies, comma-separated; `policy:private` gives each replica its own SSD directory")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-prompts", type=int, default=4, help="distinct system prompts shared by the conversations")
    ap.add_argument("--system-words", type=int, default=200, help="about this many words per system prompt")
    ap.add_argument("--tool-words", type=int, default=40, help="about this many words of tool output per turn, unique to the conversation")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8, help="turns in flight at once")
    ap.add_argument("--client-retries", type=int, default=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--kv-memory", default="1G")
    ap.add_argument("--threads", type=int, default=1, help="WICK_THREADS per replica")
    ap.add_argument("--write-max-defer", type=float, default=1.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--port-base", type=int, default=18400, help="router port; replicas take the next ones")
    ap.add_argument("--kill-at", type=float, default=None, help="kill a replica when this fraction of turns is done")
    ap.add_argument("--kill-index", type=int, default=1)
    ap.add_argument("--kill-signal", choices=["KILL", "TERM"], default="KILL")
    ap.add_argument("--restart-after", type=float, default=3.0, help="seconds until the killed replica restarts")
    ap.add_argument("--add-at", type=float, default=None, help="add a replica when this fraction of turns is done")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="extra vllm-router argument (repeat), e.g. --router-arg=--balance-abs-threshold --router-arg=2")
    ap.add_argument("--wick", default=str(ROOT / "target" / "release" / "wick"))
    ap.add_argument("--router-venv", default=None, help="default: created by scripts/cluster/setup.sh")
    ap.add_argument("--work", default=str(ROOT / "target" / "cluster"))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.router_venv is None:
        args.router_venv = subprocess.run([str(ROOT / "scripts" / "cluster" / "setup.sh")], check=True,
                                          capture_output=True, text=True).stdout.strip()
    logs = Path(tempfile.mkdtemp(prefix="logs-", dir=args.work))
    log(f"logs in {logs}")
    load_before = os.getloadavg()
    runs = []
    for policy in args.policies.split(","):
        runs.append(bench_policy(args, policy, logs))
        print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("errors",)}, indent=1), flush=True)
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "nproc": os.cpu_count(),
              "runs": runs}
    if len(runs) >= 2 and runs[1]["ttft_p50_s"]:
        report["ttft_p50_ratio"] = round(runs[0]["ttft_p50_s"] / runs[1]["ttft_p50_s"], 3)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    failed = sum(len(r["failed_conversations"]) for r in runs)
    print(json.dumps({"ttft_p50_ratio": report.get("ttft_p50_ratio"), "failed_conversations": failed,
                      "loadavg": [load_before, report["loadavg_after"]]}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
