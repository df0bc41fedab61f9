"""`python -m export train-draft`: a self-distilled EAGLE draft head (see docs/train-draft.md).

prompts (training requests) -> data (target answers, hidden states, soft labels) -> eagle (the
head, PyTorch) -> train -> graph / assemble (ONNX draft folder) -> evaluate (runtime acceptance);
run.py chains them with resume and a time budget.
"""
