#!/usr/bin/env python3
"""`wick train` against PyTorch + PEFT on the same CPU: LoRA SFT tokens/s and peak memory.

Both sides train the same base (one f32 safetensors folder, by default made once from the
default SmolLM2-135M GGUF), on the same synthetic rows, with the same shapes, on THREADS
threads:

- wick: `wick train MODEL --method sft --batch B --seq S --iters N --rank 8 --scale 1
  --threads T` (AdamW, cosine schedule, gradient clip 1.0, weight decay 0.01: its defaults);
- PyTorch: transformers' model in f32, PEFT LoRA r=8 with lora_alpha=8 (wick's `--scale 1`
  is the absolute multiplier α of α·B·A, PEFT's lora_alpha = α·r), no dropout, all seven
  projections, `torch.optim.AdamW` with the same schedule, clip and weight decay, in a plain
  loop (`model(input_ids, labels).loss.backward(); clip; opt.step()`), no Trainer, no
  gradient checkpointing, `torch.set_num_threads(T)`.

Every row is a `text` row of more words than S tokens, so both cut it to exactly S tokens
and every step trains on B·S tokens (wick's metrics.jsonl `tokens` is checked against it).
tokens/s counts the steps after the first --warmup steps only (model load, tokenization and
the warm-up steps are outside): wick's from metrics.jsonl (its cumulative `tokens_per_s`
gives each step's end time), PyTorch's from a clock around each step. Peak memory is each
process's maximum resident set size (wait4's ru_maxrss: the whole run, load included).

Rounds alternate the two sides A B A B, every shape in every round, each run a fresh
process; `--baseline OTHER_WICK` adds a third side, another wick build, to every round
(A A' B), so two builds are compared with each other and with PyTorch in the same minutes. Before each run the script waits until the machine is quiet (no cargo/rustc/linker
process, other CPU use under --max-busy cores over a 3 s sample); during each run it
records the CPU time used by everything but the run (`others`, in cores); a run during
which others used more than --max-busy cores is done again (--attempts in all, the least
disturbed one kept), so what contention is left shows in the output.

    # a venv with the pins of requirements.txt beside this script, then:
    python scripts/bench/train_vs_peft.py --rounds 2 --steps 8
    # or: scripts/bench/train_vs_peft.sh --rounds 2 --steps 8   (makes the venv first)

Needs: target/release/wick (cargo build --release -p wick), the default model
(`wick pull default`, into $WICK_HOME, default ~/.cache/wick), and a python with the pins of
scripts/bench/requirements.txt for the PyTorch side and the one-time GGUF → safetensors
conversion (`--python`, default: this interpreter).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, SCALE, LR, WEIGHT_DECAY, GRAD_CLIP = 8, 1.0, 2e-4, 0.01, 1.0
BUILDERS = {"cargo", "rustc", "cc1", "cc1plus", "ld", "ld.lld", "lld", "mold", "cc", "c++", "clang"}
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there would their we him been has when who will more no "
         "if out so said what up its about into than them can only other new some could time these "
         "two may then do first any my now such like our over man me even most made after also did "
         "many before must through back years where much your way well down should because each just "
         "those people how too little state good very make world still own see men work long get here "
         "between both life being under never day same another know while last might us great old year "
         "off come since against go came right used take three small river water light house garden").split()


def wick_home() -> Path:
    return Path(os.environ.get("WICK_HOME", Path.home() / ".cache/wick"))


# ---------------------------------------------------------------------------------------------
# Runs in the torch python: the one-time conversion and the PyTorch side.

def convert(gguf: Path, out: Path):
    """GGUF (any quantization) → an f32 safetensors folder both sides load."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers will not save_pretrained a model loaded from GGUF: write the dequantized
    # weights and the config as a plain checkpoint (tied head left out, as save_pretrained does).
    tmp.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(k, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)


def torch_worker(model_dir: str, data: str, batch: int, seq: int, steps: int, threads: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for line in open(data):
        ids = tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert len(ids) >= seq, f"a row has {len(ids)} tokens, fewer than --seq {seq}"
        rows.append(ids[:seq])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=SCALE * RANK, lora_dropout=0.0,
                                             target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY)
    sched = get_cosine_schedule_with_warmup(opt, 0, steps)
    batches = [torch.tensor([rows[(k * batch + i) % len(rows)] for i in range(batch)]) for k in range(steps)]
    step_s, losses = [], []
    for ids in batches:
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t)
        losses.append(loss.item())
    print(json.dumps({"step_s": step_s, "loss": losses, "tokens_per_step": batch * seq,
                      "torch": torch.__version__, "lora_params": sum(p.numel() for p in params)}))


# ---------------------------------------------------------------------------------------------
# The driver: needs only the standard library.

def cpu_busy_jiffies():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return sum(v[:8]) - idle  # user nice system idle iowait irq softirq steal


def builders_running():
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm in BUILDERS:
                found.add(comm)
    return sorted(found)


def wait_quiet(max_busy: float, max_wait: float) -> float:
    """Waits until no build runs and other CPU use is under max_busy cores; returns that use."""
    hz = os.sysconf("SC_CLK_TCK")
    start = time.monotonic()
    while True:
        b0 = cpu_busy_jiffies()
        time.sleep(3)
        busy = (cpu_busy_jiffies() - b0) / hz / 3
        builds = builders_running()
        if (busy <= max_busy and not builds) or time.monotonic() - start > max_wait:
            if busy > max_busy or builds:
                print(f"  (machine still busy after {max_wait:.0f} s: {busy:.2f} cores, {builds}; measuring anyway)",
                      flush=True)
            return busy
        print(f"  waiting for a quiet machine: {busy:.2f} cores busy, builds {builds or 'none'}", flush=True)
        time.sleep(20)


def run_child(cmd, env):
    """Runs cmd; its output, wall and CPU seconds, peak RSS (bytes) and the cores others used meanwhile."""
    hz = os.sysconf("SC_CLK_TCK")
    b0, t0 = cpu_busy_jiffies(), time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    bufs = {}
    drains = [threading.Thread(target=lambda n=n, f=f: bufs.__setitem__(n, f.read()))
              for n, f in (("out", p.stdout), ("err", p.stderr))]
    for t in drains:
        t.start()
    _, status, ru = os.wait4(p.pid, 0)  # reaped here, so ru is this child's own rusage
    for t in drains:
        t.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    total_busy = (cpu_busy_jiffies() - b0) / hz
    child_cpu = ru.ru_utime + ru.ru_stime
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{bufs['err'].decode()[-4000:]}")
    return {"stdout": bufs["out"].decode(), "wall_s": wall, "cpu_s": child_cpu, "sys_s": ru.ru_stime,
            "peak_rss": ru.ru_maxrss * 1024, "others_cores": max(0.0, total_busy - child_cpu) / wall}


def make_data(work: Path, seq: int, rows: int) -> Path:
    d = work / f"data-seq{seq}"
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seq)
    with open(d / "train.jsonl", "w") as f:
        for _ in range(rows):
            words = [rng.choice(WORDS) for _ in range(seq + seq // 4 + 8)]
            f.write(json.dumps({"text": " ".join(words).capitalize() + "."}) + "\n")
    return d


def wick_side(args, model_dir, data, batch, seq, binary=None):
    out_dir = args.work / f"wick-out-{batch}x{seq}"
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), WICK_THREADS=str(args.threads))
    cmd = [str(binary or args.wick), "train", str(model_dir), "--data", str(data), "--method", "sft",
           "--adapter", str(out_dir), "--iters", str(args.steps), "--batch", str(batch), "--seq", str(seq),
           "--rank", str(RANK), "--scale", str(SCALE), "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY),
           "--grad-clip", str(GRAD_CLIP), "--schedule", "cosine", "--warmup", "0", "--threads", str(args.threads)]
    r = run_child(cmd, env)
    steps = [json.loads(line) for line in open(out_dir / "metrics.jsonl") if '"tokens_per_s"' in line]
    cum, ends = 0, []
    for s in steps:
        if s["tokens"] != batch * seq:
            sys.exit(f"wick trained {s['tokens']} tokens in step {s['step']}, not {batch * seq}")
        cum += s["tokens"]
        ends.append(cum / s["tokens_per_s"])  # seconds since training started, at this step's end
    w = args.warmup
    r["step_s"] = [b - a for a, b in zip([0.0] + ends, ends)]
    r["tokens_per_s"] = (len(steps) - w) * batch * seq / (ends[-1] - ends[w - 1] if w else ends[-1])
    r["loss"] = [s["loss"] for s in steps]
    return r


def torch_side(args, model_dir, data, batch, seq):
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [args.python, str(Path(__file__).resolve()), "torch-worker", str(model_dir), str(data / "train.jsonl"),
           str(batch), str(seq), str(args.steps), str(args.threads)]
    r = run_child(cmd, env)
    res = json.loads(r["stdout"].strip().splitlines()[-1])
    r.update(res)
    timed = res["step_s"][args.warmup:]
    r["tokens_per_s"] = len(timed) * batch * seq / sum(timed)
    return r


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "torch-worker":
        a = sys.argv[2:]
        return torch_worker(a[0], a[1], *(int(x) for x in a[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "convert":
        return convert(Path(sys.argv[2]), Path(sys.argv[3]))

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path,
                    default=wick_home() / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="base the f32 safetensors folder is made from (once)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="an f32 Hugging Face folder to train instead (default: WORK/smollm2-135m-f32)")
    ap.add_argument("--wick", type=Path, default=ROOT / "target/release/wick")
    ap.add_argument("--baseline", type=Path, action="append", default=[],
                    help="another wick binary run in every round beside --wick (an A/B of two builds in the "
                         "same minutes); its side is named after its file; may be repeated")
    ap.add_argument("--python", default=sys.executable, help="python with torch, transformers and peft")
    ap.add_argument("--work", type=Path, default=ROOT / "target/bench-train")
    ap.add_argument("--shapes", default="4x256,1x512", help="BATCHxSEQ,…")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-busy", type=float, default=0.3, help="other CPU use (cores) allowed before a run")
    ap.add_argument("--max-wait", type=float, default=1800, help="seconds to wait for quiet before measuring anyway")
    ap.add_argument("--attempts", type=int, default=3,
                    help="runs of one measurement while others used more than --max-busy cores during it")
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        sys.exit("--steps must be larger than --warmup")
    args.work.mkdir(parents=True, exist_ok=True)
    for b in [args.wick, *args.baseline]:
        if not b.exists():
            sys.exit(f"{b} is missing: cargo build --release -p wick")

    model_dir = args.model_dir or args.work / "smollm2-135m-f32"
    if not (model_dir / "config.json").exists():
        print(f"== converting {args.gguf} to f32 safetensors in {model_dir}", flush=True)
        subprocess.run([args.python, str(Path(__file__).resolve()), "convert", str(args.gguf), str(model_dir)],
                       check=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1"))

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    data = {seq: make_data(args.work, seq, max(16, 2 * batch * args.steps)) for batch, seq in shapes}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"== {cpu}, {os.cpu_count()} CPUs; {args.threads} threads; {args.steps} steps, "
          f"the first {args.warmup} untimed; model {model_dir.name}", flush=True)

    runs = []
    for rnd in range(1, args.rounds + 1):
        for batch, seq in shapes:
            sides = [("wick", wick_side)]
            sides += [(b.name, lambda *a, b=b: wick_side(*a, binary=b)) for b in args.baseline]
            for side, fn in sides + [("torch", torch_side)]:
                r = None
                for attempt in range(1, args.attempts + 1):
                    quiet = wait_quiet(args.max_busy, args.max_wait)
                    a = fn(args, model_dir, data[seq], batch, seq)
                    a["busy_before"] = quiet
                    if r is None or a["others_cores"] < r["others_cores"]:
                        r = a  # the least disturbed attempt is kept
                    if a["others_cores"] <= args.max_busy:
                        break
                    print(f"  ({side} {batch}x{seq}: {a['tokens_per_s']:.1f} tok/s while others used "
                          f"{a['others_cores']:.2f} cores" + (": measuring again)" if attempt < args.attempts else ")"),
                          flush=True)
                r.pop("stdout", None)
                r.update(round=rnd, side=side, batch=batch, seq=seq, load=os.getloadavg()[0])
                runs.append(r)
                print(f"round {rnd} {batch}x{seq} {side:>5}: {r['tokens_per_s']:7.1f} tok/s, "
                      f"peak RSS {r['peak_rss'] / 1e9:.2f} GB, wall {r['wall_s']:.1f} s, "
                      f"CPU {r['cpu_s'] / r['wall_s']:.2f} cores ({r['sys_s'] / r['cpu_s']:.0%} system), others {r['others_cores']:.2f} cores, "
                      f"loss {r['loss'][0]:.3f} → {r['loss'][-1]:.3f}", flush=True)

    print(f"\n| batch × seq | wick tok/s | PyTorch+PEFT tok/s | ratio (median of rounds) | "
          f"peak RSS wick | peak RSS PyTorch |\n|---|---:|---:|---:|---:|---:|")
    for batch, seq in shapes:
        sel = lambda side: [r for r in runs if r["side"] == side and r["batch"] == batch and r["seq"] == seq]
        w, t = sel("wick"), sel("torch")
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(w, t)]
        med = lambda rs, k: statistics.median(r[k] for r in rs)
        print(f"| {batch} × {seq} | {med(w, 'tokens_per_s'):.1f} | {med(t, 'tokens_per_s'):.1f} | "
              f"**{statistics.median(ratios):.2f}×** ({min(ratios):.2f}–{max(ratios):.2f}) | "
              f"{max(r['peak_rss'] for r in w) / 1e9:.2f} GB | {max(r['peak_rss'] for r in t) / 1e9:.2f} GB |")
    for base in args.baseline:
        for batch, seq in shapes:
            sel = lambda side: [r for r in runs if r["side"] == side and r["batch"] == batch and r["seq"] == seq]
            w, b, t = sel("wick"), sel(base.name), sel("torch")
            vs_torch = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(b, t)]
            vs_base = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(w, b)]
            print(f"{base.name} {batch} × {seq}: {statistics.median(r['tokens_per_s'] for r in b):.1f} tok/s, "
                  f"{statistics.median(vs_torch):.2f}× PyTorch ({min(vs_torch):.2f}–{max(vs_torch):.2f}); "
                  f"wick / {base.name} {statistics.median(vs_base):.2f}× ({min(vs_base):.2f}–{max(vs_base):.2f})")
    torch_version = next((r["torch"] for r in runs if "torch" in r), "?")
    print(f"\n{cpu}; {args.threads} threads; torch {torch_version}; "
          f"others' CPU during runs {min(r['others_cores'] for r in runs):.2f}–"
          f"{max(r['others_cores'] for r in runs):.2f} cores")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
