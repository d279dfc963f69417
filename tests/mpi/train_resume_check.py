"""Compare the models of two `pipesgd train` checkpoints bitwise (run without mpirun).

Usage: train_resume_check.py DIR_A DIR_B
"""

import sys

import torch

a = torch.load(f"{sys.argv[1]}/checkpoint.pt", weights_only=False)
b = torch.load(f"{sys.argv[2]}/checkpoint.pt", weights_only=False)
assert a["iteration"] == b["iteration"], (a["iteration"], b["iteration"])
for name, value in a["model"].items():
    assert torch.equal(value, b["model"][name]), f"{name} differs after resume"
print("train_resume_check: identical")
