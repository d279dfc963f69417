// Shared-memory links between ring neighbours on one node.
//
// Each rank owns an inbox in POSIX shared memory that its left neighbour copies
// segments into, and maps its right neighbour's inbox to copy its own segments
// out. A segment then costs one user-space memcpy on the sender instead of a
// kernel CMA copy on the receiver: process_vm_readv pins every page it touches and
// copied 4 MiB at 21 GB/s on the development VM, against memcpy's 57 GB/s
// (docs/engine.md). A reduce-scatter hop adds straight out of
// the inbox, so the data is copied once per hop either way.
//
// An inbox is a single-producer single-consumer ring of `slots` slots: the sender
// publishes message m into slot m % slots once the receiver has released message
// m - slots, and the receiver consumes messages strictly in order. The counters
// never wrap (64 bits) and outlive operations, so the next operation's first
// segments may already wait behind this one's last.
//
// Waiting blocks in the kernel instead of spinning (docs/engine.md, "Waiting on a
// link"): a push link moves data only while the sending rank runs, so a rank that
// spins for its neighbour takes the very CPU time the neighbour needs whenever the
// two do not run at once (ranks sharing a core, a hypervisor time-sharing the
// virtual CPUs). Each inbox carries a doorbell, a futex word that both neighbours
// ring: the left after publishing into it, the right after releasing a slot of its
// own inbox (room for this rank's sends). A rank that found nothing to do sleeps on
// its own doorbell; the neighbours ring it only when it says it sleeps.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "shm_region.h"

namespace pipesgd {

// What a slot carries besides its bytes: the receiver checks it against the unit
// it expects, so segments can never be added to the wrong place.
struct ShmMessage {
  std::uint64_t seq = 0;  // the operation's sequence number
  std::int32_t step = 0;
  std::int32_t reserved = 0;
  std::uint64_t segment = 0;
  std::uint64_t bytes = 0;
};

class ShmLinks final : public Doorbell {
 public:
  // Collective over `comm`. Links join this rank to its left neighbour when
  // `left_on_node` and to its right one when `right_on_node` (both ends of an edge
  // must say the same); every rank has an inbox, whose doorbell it sleeps on, with
  // slots only when its left neighbour sends into it. Each slot holds up to
  // `slot_bytes`. Returns nullptr on every rank if any rank could not create or map
  // its links (no /dev/shm, too small): the engine then keeps to MPI messages.
  // `why_not` says what failed on this rank.
  static std::unique_ptr<ShmLinks> create(MPI_Comm comm, std::size_t slot_bytes, int slots,
                                          bool left_on_node, bool right_on_node,
                                          std::string* why_not);
  ~ShmLinks();
  ShmLinks(const ShmLinks&) = delete;
  ShmLinks& operator=(const ShmLinks&) = delete;

  // Which neighbours the links reach; the other edges go by MPI.
  bool reaches_left() const { return left_inbox_.base != nullptr; }
  bool reaches_right() const { return outbox_.base != nullptr; }

  // Bytes one slot of the right neighbour's inbox can take.
  std::size_t right_slot_bytes() const { return out_capacity_; }

  // A slot of the right neighbour's inbox is free.
  bool can_send() const;
  // Copies `message.bytes` bytes from `data` into the next slot and publishes it.
  // Requires can_send() and message.bytes <= right_slot_bytes().
  void send(const ShmMessage& message, const void* data);

  // The oldest unreleased message from the left neighbour, or nullptr.
  const ShmMessage* peek() const;
  // Its bytes (valid until release()).
  const unsigned char* peek_data() const;
  // Frees the oldest message's slot for the left neighbour.
  void release();

  // Sleeps until a neighbour rings this rank's doorbell or `timeout_us` passes,
  // unless `ready()` (called after this rank has said it sleeps, so no ring is
  // lost in between) is already true. Returns ready()'s answer when it did not sleep.
  bool sleep_unless(const std::function<bool()>& ready, int timeout_us) override;
  // Wakes this rank's own sleeping comm thread (shutdown, from another thread).
  void wake_self() override;

 private:
  struct Mapping {
    void* base = nullptr;
    std::size_t bytes = 0;
  };
  ShmLinks() = default;

  Mapping inbox_;
  Mapping outbox_;      // the right neighbour's inbox
  Mapping left_inbox_;  // the left neighbour's inbox: only its doorbell is used
  int slots_ = 0;
  std::size_t in_stride_ = 0;
  std::size_t out_stride_ = 0;
  std::size_t out_capacity_ = 0;
  std::uint64_t sent_ = 0;      // messages this rank published to the right
  std::uint64_t received_ = 0;  // messages this rank released from the left
};

}  // namespace pipesgd
