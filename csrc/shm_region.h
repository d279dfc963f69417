// What the node's shared-memory transports (shm_links.h, shm_board.h) have in common:
// named POSIX shared memory that one rank creates and others map, and doorbells, futex
// words in that memory that a rank sleeps on and other processes ring.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace pipesgd {

// One name per engine (collective over `comm`): rank 0's process id, the time and a
// per-process counter, broadcast.
std::uint64_t shared_region_token(MPI_Comm comm);
// "/pipesgd-<token>-<what><index>".
std::string shared_region_name(std::uint64_t token, const char* what, int index);

// Creates and maps a region of `bytes`; the memory is reserved up front, so a full
// /dev/shm fails here instead of with SIGBUS on first touch. nullptr, and `why_not`
// set, on failure (the name is then unlinked).
void* create_shared_region(const std::string& name, std::size_t bytes, std::string* why_not);
// Maps an existing region; `bytes` receives its size.
void* map_shared_region(const std::string& name, std::size_t* bytes, std::string* why_not);
// Whether `mine` holds on every rank of `comm` (collective).
bool on_all_ranks(MPI_Comm comm, bool mine);

// A doorbell in shared memory: the futex word others ring and whether its owner sleeps.
struct BellWord {
  std::atomic<std::uint32_t> bell{0};
  std::atomic<std::uint32_t> sleeping{0};
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free &&
                  sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t),
              "a doorbell is used as a futex word across processes");

// Rings `b` if its owner sleeps. The caller's last store (what the owner waits for) and
// the fence order against the owner's `sleeping` store and fence in sleep_on_bell():
// either the owner's ready() sees the new store or this sees it sleeping.
void ring_bell(BellWord* b);
// Sleeps on `b` until rung or `timeout_us` passes, unless `ready()` (called after saying
// it sleeps, so no ring is lost in between) already holds; returns ready()'s answer when
// it did not sleep.
bool sleep_on_bell(BellWord* b, const std::function<bool()>& ready, int timeout_us);
// Rings `b` whether or not its owner says it sleeps (a wake from another thread).
void wake_bell(BellWord* b);

// What a rank waiting on a shared-memory transport sleeps on (CommContext::wait_on_bell).
class Doorbell {
 public:
  virtual ~Doorbell() = default;
  // Sleeps until rung or `timeout_us` passes, unless `ready()` holds: sleep_on_bell().
  virtual bool sleep_unless(const std::function<bool()>& ready, int timeout_us) = 0;
  // Wakes this rank's own sleeper (shutdown, from another thread).
  virtual void wake_self() = 0;
};

}  // namespace pipesgd
