"""Compare the models of two `pipesgd train` checkpoints (run without mpirun): bitwise, or
within an absolute tolerance.

Usage: train_resume_check.py DIR_A DIR_B [ATOL]
"""

import sys

import torch

a = torch.load(f"{sys.argv[1]}/checkpoint.pt", weights_only=False)
b = torch.load(f"{sys.argv[2]}/checkpoint.pt", weights_only=False)
atol = float(sys.argv[3]) if len(sys.argv) > 3 else None
assert a["iteration"] == b["iteration"], (a["iteration"], b["iteration"])
for name, value in a["model"].items():
    other = b["model"][name]
    if atol is None:
        assert torch.equal(value, other), f"{name} differs after resume"
    else:
        gap = (value - other).abs().max().item()
        assert gap <= atol, f"{name} differs by {gap} > {atol}"
print("train_resume_check: identical" if atol is None else f"train_resume_check: within {atol}")
