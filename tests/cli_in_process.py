"""Run `pipesgd ...` inside the test process, for commands that start no MPI job.

Returns what a subprocess would (exit status, standard output and error) without a new
interpreter, whose import of torch costs seconds on each call. The entry point itself
(`python -m pipesgd.cli`) is tested once, in test_planner_cli.py.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import traceback

import torch

from pipesgd.cli import main


def pipesgd(*args: str) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()  # commands that run a job set it to 1
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as stop:  # argparse's errors, and commands that exit
            if isinstance(stop.code, str):
                print(stop.code, file=err)
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except Exception:  # as the interpreter would: the traceback, status 1
            traceback.print_exc()
            code = 1
        finally:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["pipesgd", *args], code, out.getvalue(),
                                       err.getvalue())
