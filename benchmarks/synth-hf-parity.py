#!/usr/bin/env python3
"""transformers and layerstream on the very same synthesized weights.

    python3 benchmarks/synth-hf-parity.py [--shape tiny] [--dtype q4_k] [--layers 2] [--tokens 16]

Runs `layerstream synth --shape S --dtype D --layers N --hf DIR STORE`, then greedy generation of
`--tokens` tokens from a fixed list of prompt ids with transformers (f32, CPU, on DIR) and with
`layerstream run --token-ids` (on STORE, default f32-activation kernels), and prints both token lists
and the number of leading tokens they share.
Needs torch and transformers (pip); LAYERSTREAM_BIN names the binary (default
target/release/layerstream). Exits non-zero when the tokens differ before the first step whose top-2
logit gap (transformers') is under 1e-3.
"""
import argparse, json, os, subprocess, sys, tempfile

import torch
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="tiny")
ap.add_argument("--dtype", default="q4_k")
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--tokens", type=int, default=16)
a = ap.parse_args()
ls = os.environ.get("LAYERSTREAM_BIN", "target/release/layerstream")
work = tempfile.mkdtemp()
store, hf = os.path.join(work, "store"), os.path.join(work, "hf")
subprocess.run([ls, "synth", "--shape", a.shape, "--dtype", a.dtype, "--layers", str(a.layers),
                "--hf", hf, store], check=True, stdout=subprocess.DEVNULL)
model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
vocab = model.config.vocab_size
ids = [1 + (i * 7919) % (vocab - 1) for i in range(12)]
with torch.no_grad():
    x = torch.tensor([ids])
    gaps, out = [], []
    for _ in range(a.tokens):
        logits = model(x).logits[0, -1]
        top = torch.topk(logits, 2).values
        gaps.append(float(top[0] - top[1]))
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
run = subprocess.run([ls, "run", "--model", store, "--token-ids", ",".join(map(str, ids)),
                      "--max-new-tokens", str(a.tokens), "--ignore-eos", "--json"],
                     check=True, capture_output=True, text=True)
got = json.loads(run.stdout.strip().splitlines()[-1])["output_ids"]
same = next((i for i, (p, q) in enumerate(zip(out, got)) if p != q), min(len(out), len(got)))
comparable = next((i for i, g in enumerate(gaps) if g < 1e-3), len(gaps))
print(f"{a.shape} {a.dtype} x{a.layers} layers, prompt of {len(ids)} ids")
print("transformers:", out)
print("layerstream: ", got)
print(f"equal for {same} of {len(out)} tokens (comparable: {comparable}; smallest top-2 gap {min(gaps):.4f})")
sys.exit(0 if same >= comparable else 1)
