"""DDP over gloo with the Pipe-SGD comm hook, under a real mpirun."""

from mpirun import run_mpi


def test_ddp_hook_matches_distributed_optimizer() -> None:
    out = run_mpi(3, "optim_ddp_hook.py", timeout=150).stdout
    assert "optim_ddp_hook: ok on 3 ranks" in out, out
