"""Could the target's own layers, some skipped, be a cheaper draft (no training)? Block influence
per layer (1 - cosine between a layer's input and output hidden states over the target's greedy
answers), then the teacher-forced top-1 agreement with the full model when the least influential
layers are skipped (docs/lab-notes/2026-12-01-draft-bounds.md: 2 layers skipped -> 0.73,
8 -> 0.20 on SmolLM2-135M).

Needs the export extra (torch, transformers) and a Hugging Face folder of the model, e.g. the one
`python -m specdec_rt bench --modes hf_ar` leaves in ~/.cache/specdec-rt/bench/hf-smollm2-135m.
Usage: python scripts/experiments/layer_skip.py [HF_FOLDER] [PROMPTS]
"""
import json
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

torch.set_num_threads(2)
folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path.home() / ".cache/specdec-rt/bench/hf-smollm2-135m")
n_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 24
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
tok = Tokenizer.from_file(str(Path.home() / ".cache/specdec-rt/models/smollm2-135m/tokenizer.json"))
lines = resources.files("specdec_rt.tooling").joinpath("data/prompts.jsonl").read_text().splitlines()
texts = []
for line in lines[:n_prompts]:
    d = json.loads(line)
    p = d.get("prompt") or d["messages"][-1]["content"]
    texts.append(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n")

seqs = []  # (prompt length, prompt + greedy answer [1, S])
with torch.no_grad():
    for t in texts:
        ids = torch.tensor([tok.encode(t).ids])
        seqs.append((ids.shape[1], model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)))
layers = model.model.layers
n_layers = len(layers)
influence = np.zeros(n_layers)
with torch.no_grad():
    for n0, out in seqs:
        hs = model(out, output_hidden_states=True).hidden_states
        for i in range(n_layers):
            cos = torch.nn.functional.cosine_similarity(hs[i][0, n0:], hs[i + 1][0, n0:], dim=-1)
            influence[i] += (1 - cos).mean().item() / len(seqs)
print("block influence per layer:", np.round(influence, 3).tolist())


def agreement(skip: set[int]) -> float:
    keep = [i for i in range(n_layers) if i not in skip]
    model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    model.config.num_hidden_layers = len(keep)
    for j, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = j
    hit = total = 0
    with torch.no_grad():
        for n0, out in seqs:
            guess = model(out).logits[0, n0 - 1 : -1].argmax(-1)
            hit += (guess == out[0, n0:]).sum().item()
            total += guess.numel()
    model.model.layers, model.config.num_hidden_layers = layers, n_layers
    for j, layer in enumerate(layers):
        layer.self_attn.layer_idx = j
    return hit / total


order = np.argsort(influence)
print("no layer skipped:", round(agreement(set()), 3))
for n in (2, 4, 6, 8):
    skip = set(order[:n].tolist())
    print(f"{n} least influential skipped {sorted(skip)}: agreement {agreement(skip):.3f}")
