// Buffers that every rank of one node maps (Engine::shared_buffer). One collective
// allocation is one region of p equal parts, part q being rank q's buffer, so an
// allreduce on such buffers reads every rank's data where it lies and writes the sums
// straight into every part (allreduce/board.h): no copy into links or onto a board, and
// less than half the memory traffic of a ring (docs/engine.md, "Buffers in shared memory").
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace pipesgd {

// One collective allocation, mapped by this rank; unmapped when the last user drops it
// (the engine's registry, an operation on it, the array lent to Python).
class SharedBuffer {
 public:
  SharedBuffer(void* base, std::size_t mapped, std::uint64_t id, int rank, int ranks,
               std::size_t part_bytes, std::size_t stride);
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  // The allocation's number: the same on every rank (allocations are collective).
  std::uint64_t id() const { return id_; }
  int ranks() const { return ranks_; }
  // Bytes of each rank's part.
  std::size_t part_bytes() const { return part_bytes_; }
  // Rank q's part; part(rank) is this rank's buffer.
  unsigned char* part(int q) const;
  unsigned char* mine() const { return part(rank_); }

 private:
  void* base_;
  std::size_t mapped_;
  std::uint64_t id_;
  int rank_;
  int ranks_;
  std::size_t part_bytes_;
  std::size_t stride_;  // between parts: part_bytes_ rounded up to a page
};

// Where an operation's buffer lies in shared memory, if it does.
struct SharedPlace {
  std::shared_ptr<const SharedBuffer> buffer;  // null: in this process's own memory
  std::size_t offset = 0;                      // of the data within each part
};

// The allocations of one engine, whose ranks are all on one node.
class SharedBuffers {
 public:
  // Collective over `comm`, which it duplicates (allocations never meet the comm
  // thread's collectives).
  explicit SharedBuffers(MPI_Comm comm);
  ~SharedBuffers();
  SharedBuffers(const SharedBuffers&) = delete;
  SharedBuffers& operator=(const SharedBuffers&) = delete;

  // Collective: every rank, in the same order, with the same `bytes`. Zero-filled.
  // nullptr on every rank when `bytes` is 0, or when some rank could not map it
  // (`why_not` set). Throws std::invalid_argument when ranks asked for different sizes.
  std::shared_ptr<SharedBuffer> allocate(std::size_t bytes, std::string* why_not);
  // Collective like allocate(), for the engine's own use (the staged board's pieces:
  // allreduce/board.h): numbered apart from the caller's buffers, whose numbers errors
  // show, and never found by find().
  std::shared_ptr<SharedBuffer> allocate_stage(std::size_t bytes, std::string* why_not);
  // The allocation whose part for this rank holds [data, data + bytes), if any.
  SharedPlace find(const void* data, std::size_t bytes) const;
  // Frees the duplicated communicator (before MPI_Finalize); allocate() fails after.
  void close();

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int ranks_ = 1;
  std::uint64_t token_ = 0;
  std::uint64_t next_id_ = 0;
  std::uint64_t next_stage_id_ = 0;
  // One collective allocation named `kind` and `id`; allocate_mutex_ held.
  std::shared_ptr<SharedBuffer> map_region(std::size_t bytes, const char* kind, std::uint64_t id,
                                           std::string* why_not);
  // Held through an allocation's collectives; find() does not wait for them.
  std::mutex allocate_mutex_;
  mutable std::mutex live_mutex_;  // guards live_
  // Each live allocation by the address of this rank's part: find() is on every
  // operation's submission, so one lookup, not a scan.
  std::map<std::uintptr_t, std::weak_ptr<SharedBuffer>> live_;
};

}  // namespace pipesgd
