// The ring's two edges at one rank: segments leave for the right neighbour and arrive
// from the left, each edge either as MPI messages or through a shared-memory link
// (shm_links.h), chosen per edge: shared memory where both ends are on one node, MPI
// elsewhere. The ring (ring.cc) is one loop over its units that does not know which.
//
// An edge carries the operation's header first, then the units in the order the
// receiver processes them (step by step, segment by segment).
#pragma once

#include <cstddef>
#include <memory>

#include "allreduce/ring_header.h"
#include "allreduce/ring_layout.h"
#include "allreduce/workspace.h"
#include "comm_context.h"
#include "operation.h"
#include "shm_links.h"

namespace pipesgd {

// One unit of receive work: segment `seg` of chunk `chunk` arriving at `step`, `bytes`
// on the wire.
struct RingUnit {
  int step;
  int chunk;
  std::size_t seg;
  std::size_t bytes;
};

// This rank's edge to its right neighbour.
class RingOut {
 public:
  virtual ~RingOut() = default;
  // The header goes ahead of every segment.
  virtual void send_header(const RingHeader& header) = 0;
  // Hands segment `seg` of `chunk` at `step` (`bytes` at `data`) to the link. `data`
  // stays unchanged until sent() says so (reduce-scatter) or the operation ends.
  virtual void send(int step, int chunk, std::size_t seg, const void* data,
                    std::size_t bytes) = 0;
  // Whether step-0 segments are best released only as the neighbour gets to them
  // (MPI: unexpected messages cost a copy and a linear search). A link that queues
  // and copies out when the neighbour has room never floods it.
  virtual bool throttles_first_step() const = 0;
  // Moves handed-over sends on without waiting; true once every one has completed.
  virtual bool progress() = 0;
  // Whether the reduce-scatter send of segment `seg` of `chunk` has completed, so its
  // buffer may take the allgather's final bytes.
  virtual bool sent(int chunk, std::size_t seg) = 0;
  // After a failure: lets go of whatever is still posted.
  virtual void abandon() noexcept = 0;
};

// This rank's edge from its left neighbour.
class RingIn {
 public:
  virtual ~RingIn() = default;
  virtual void expect_header() = 0;
  virtual bool header_arrived() = 0;
  // The left neighbour's header; nullptr when what arrived first is not a header.
  virtual const RingHeader* take_header() = 0;
  // Whether a unit given a home lands there from the moment it is expected (a posted
  // receive), so the home must be free by then; otherwise take() copies it there.
  virtual bool lands_when_expected() const = 0;
  // Unit number `index` (0, 1, ... in arrival order) will arrive; expected at most
  // `window` ahead of the one taken. `home`: where its bytes must end (allgather), or
  // nullptr to read them where they arrive.
  virtual void expect(std::size_t index, const RingUnit& unit, unsigned char* home) = 0;
  virtual bool arrived(std::size_t index) = 0;
  // Unit `index`'s bytes once arrived(index): in `home` when it has one, else wherever
  // they arrived; valid until release().
  virtual const unsigned char* take(std::size_t index, const RingUnit& unit,
                                    unsigned char* home) = 0;
  virtual void release() = 0;
  virtual void abandon() noexcept = 0;
};

// MPI messages: tags per operation and step (CommContext); receives posted into
// `window` staging slots of `slot_bytes` from `ws`, or straight into a unit's home.
std::unique_ptr<RingOut> mpi_ring_out(CommContext& ctx, const Operation& op, int right,
                                      const RingLayout& layout);
std::unique_ptr<RingIn> mpi_ring_in(CommContext& ctx, const Operation& op, int left,
                                    Workspace& ws, std::size_t slot_bytes, int window);

// Shared-memory links: `links` must reach the right (out) or left (in) neighbour.
std::unique_ptr<RingOut> shm_ring_out(ShmLinks& links, const Operation& op, int right,
                                      const RingLayout& layout);
std::unique_ptr<RingIn> shm_ring_in(ShmLinks& links, const Operation& op, int rank,
                                    int left);

}  // namespace pipesgd
