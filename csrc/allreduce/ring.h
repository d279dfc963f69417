// Bandwidth-optimal ring AllReduce: reduce-scatter then allgather, 2(p-1)
// steps, each rank sending 2(p-1)/p of the buffer. See ring.cc.
#pragma once

#include <cstddef>

#include "allreduce/workspace.h"
#include "comm_context.h"
#include "operation.h"
#include "shm_links.h"

namespace pipesgd {

// How the ring moves its segments: each edge through a shared-memory link where `links`
// reaches that neighbour (ring_links.h), as MPI messages otherwise; cut into segments of
// `segment_bytes`, `window` of them in flight, the same on every rank (transport.h says
// why each transport has its own).
struct RingPath {
  ShmLinks* links = nullptr;  // nullptr: MPI messages on both edges
  std::size_t segment_bytes = 0;
  int window = 1;
};

// Runs `op` to completion on ctx's communicator along `path`; every rank must call it
// for the same sequence number with the same path. Throws OpFailure on mismatch, abort
// or MPI error.
void ring_allreduce(CommContext& ctx, Workspace& ws, Operation& op, const RingPath& path);

}  // namespace pipesgd
