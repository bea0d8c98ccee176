"""bench/gpt's tables from run.sh's raw results (--dir): the step-time
breakdown per side and case, torch.compile's compile time, and the MFU of
every run against the machine's measured fp32 matmul peak (bench_matmul
--peak), with one JSON line per MFU:
  {"bench": "gpt", "case", "metric": "mfu", "impl", "mfu", "model_gflops",
   "peak_gflops", "peak_threads", "machine"}"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from machine import machine  # noqa: E402

ROWS = [("dtrain", "dtrain.jsonl"), ("dtrain aten", "dtrain_aten.jsonl"), ("torch", "peer.jsonl"),
        ("compile", "compile.jsonl")]


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def flops_per_token(n_layer, n_embd, block_size, vocab_size):
    """nanoGPT's estimate_mfu: 6 N + 12 L d T, N the parameters that take
    part in a product (the blocks' Linears and LayerNorms, the tied head; not
    the position embedding), d = heads x head size, T the context."""
    n = n_layer * (12 * n_embd * n_embd + 2 * n_embd) + vocab_size * n_embd + n_embd
    return 6 * n + 12 * n_layer * n_embd * block_size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-layer", type=int, required=True)
    ap.add_argument("--n-head", type=int, required=True)
    ap.add_argument("--n-embd", type=int, required=True)
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--data-dir", default=os.path.join(
        os.environ.get("DTRAIN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                       os.path.expanduser("~/.cache"), "dtrain"),
        "shakespeare_char"))
    args = ap.parse_args()
    with open(os.path.join(args.data_dir, "meta.json")) as f:
        vocab = json.load(f)["vocab_size"]
    runs = {(side, r["case"]): r for side, name in ROWS for r in load(os.path.join(args.dir, name))}
    peaks = {r["threads"]: r["gflops"] for r in load(os.path.join(args.dir, "peak.jsonl")) if r["case"] == "peak"}
    where = machine()

    print("# step-time breakdown, mean ms per step after 10 warm-up steps (ddp2: backward includes the all-reduce;")
    print("# exposed communication = ddp2 backward - single backward, same per-rank batch and threads)")
    print(f"{'side':13}{'case':8}{'forward':>10}{'backward':>10}{'optimizer':>10}{'comm':>8}{'tok/s':>10}"
          f"{'val':>8}{'wall s':>8}  kernel")
    for side, _ in ROWS:
        for case in ["single", "ddp2"]:
            r = runs.get((side, case))
            if r is None:
                continue
            ms = r["step_ms"]
            comm = ""
            if case == "ddp2" and (side, "single") in runs:
                comm = f"{ms['backward'] - runs[(side, 'single')]['step_ms']['backward']:.1f}"
            print(f"{side:13}{case:8}{ms['forward']:10.1f}{ms['backward']:10.1f}{ms['optimizer']:10.1f}{comm:>8}"
                  f"{r['tokens_per_second']:10.0f}{r['val_loss']:8.4f}{r['wall_seconds']:8.1f}  "
                  f"{r.get('linear_kernel', 'aten')}")
    compiled = runs.get(("compile", "single"))
    if compiled:
        print(f"# torch.compile: {compiled['compile_seconds']:.1f} s compiling (first step and first evaluation"
              f" beyond a steady one), steady state {compiled['steady_step_ms']:.1f} ms/step,"
              f" {compiled['tokens_per_second_with_compile']:.0f} tokens/s over the whole run")

    per_token = flops_per_token(args.n_layer, args.n_embd, args.block_size, vocab)
    print(f"# MFU: {per_token / 1e6:.2f} MFLOP per token (6N + 12LdT) x tokens/s over the measured fp32 matmul"
          f" peak: " + ", ".join(f"{t} thread(s) {g:.1f} GFLOP/s" for t, g in sorted(peaks.items())))
    for (side, case), r in runs.items():
        peak_threads = args.threads if case == "single" else max(peaks, default=1)
        peak = peaks.get(peak_threads) or peaks.get(max(peaks, default=1))
        if not peak:
            continue
        gflops = per_token * r["tokens_per_second"] / 1e9
        print(f"{side:13}{case:8} {gflops:7.1f} GFLOP/s  MFU {gflops / peak:6.1%}")
        print(json.dumps({"bench": "gpt", "case": case, "metric": "mfu", "impl": side, "mfu": round(gflops / peak, 4),
                          "model_gflops": round(gflops, 2), "peak_gflops": peak, "peak_threads": peak_threads,
                          "machine": where}))


if __name__ == "__main__":
    main()
