// Bandwidth-optimal ring AllReduce: reduce-scatter then allgather, 2(p-1)
// steps, each rank sending 2(p-1)/p of the buffer. See ring.cc.
#pragma once

#include "allreduce/workspace.h"
#include "comm_context.h"
#include "operation.h"
#include "shm_links.h"

namespace pipesgd {

// Runs `op` to completion on ctx's communicator; every rank must call it for
// the same sequence number. `links`: the ring neighbours' shared-memory links, or
// nullptr to send segments as MPI messages. Throws OpFailure on mismatch, abort or
// MPI error.
void ring_allreduce(CommContext& ctx, Workspace& ws, Operation& op, ShmLinks* links);

}  // namespace pipesgd
