"""An engine on MPI initialized below MPI_THREAD_MULTIPLE refuses to start, saying why."""

import mpi4py

mpi4py.rc.thread_level = "serialized"

from mpi4py import MPI  # noqa: E402

import pipesgd  # noqa: E402

assert MPI.Query_thread() < MPI.THREAD_MULTIPLE
try:
    pipesgd.Engine(MPI.COMM_WORLD)
except RuntimeError as e:
    assert "MPI_THREAD_MULTIPLE" in str(e) and "MPI_THREAD_SERIALIZED" in str(e), e
    assert "thread_level" in str(e), e
else:
    raise AssertionError("engine started without MPI_THREAD_MULTIPLE")
print("engine_thread_level ok")
