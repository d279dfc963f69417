#include "shm_links.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>

#include "mpi_check.h"

namespace pipesgd {
namespace {

constexpr std::size_t kLine = 64;

// The inbox's first lines: the counters on lines of their own (the sender writes
// head, the receiver tail), the owner's doorbell, then what the sender must know
// about the slots. Lines are 128 bytes apart: the adjacent-line prefetchers of
// current x86 cores move lines in pairs.
constexpr std::size_t kPair = 2 * kLine;
struct Control {
  alignas(kPair) std::atomic<std::uint64_t> head{0};  // messages published
  alignas(kPair) std::atomic<std::uint64_t> tail{0};  // messages released
  // The futex word neighbours ring, and whether the owner sleeps on it.
  alignas(kPair) std::atomic<std::uint32_t> bell{0};
  std::atomic<std::uint32_t> sleeping{0};
  alignas(kPair) std::uint64_t slot_bytes = 0;
  std::uint64_t slots = 0;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free &&
                  std::atomic<std::uint32_t>::is_always_lock_free,
              "shared-memory counters must be lock-free to work across processes");
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t),
              "the doorbell is used as a futex word");
static_assert(sizeof(ShmMessage) <= kLine, "a slot's message header fits one line");

constexpr std::size_t round_up(std::size_t x) { return (x + kLine - 1) / kLine * kLine; }
constexpr std::size_t kControlBytes = round_up(sizeof(Control));

Control* control(void* base) { return static_cast<Control*>(base); }
unsigned char* slot_at(void* base, std::size_t stride, std::uint64_t index, int slots) {
  return static_cast<unsigned char*>(base) + kControlBytes +
         static_cast<std::size_t>(index % static_cast<std::uint64_t>(slots)) * stride;
}

std::string inbox_name(std::uint64_t token, int rank) {
  char name[64];
  std::snprintf(name, sizeof name, "/pipesgd-%016llx-%d",
                static_cast<unsigned long long>(token), rank);
  return name;
}

std::string failure(const char* what, const std::string& name) {
  return std::string(what) + " " + name + ": " + std::strerror(errno);
}

// Creates and maps this rank's inbox; the memory is reserved up front, so a full
// /dev/shm fails here instead of with SIGBUS on first touch.
void* create_inbox(const std::string& name, std::size_t bytes, std::string* why_not) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why_not = failure("shm_open", name);
    return nullptr;
  }
  void* base = MAP_FAILED;
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    errno = err;
    *why_not = failure("posix_fallocate", name);
  } else {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) *why_not = failure("mmap", name);
  }
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return nullptr;
  }
  return base;
}

void* map_inbox(const std::string& name, std::size_t* bytes, std::string* why_not) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    *why_not = failure("shm_open", name);
    return nullptr;
  }
  struct stat st {};
  void* base = MAP_FAILED;
  if (fstat(fd, &st) != 0) {
    *why_not = failure("fstat", name);
  } else {
    *bytes = static_cast<std::size_t>(st.st_size);
    base = mmap(nullptr, *bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) *why_not = failure("mmap", name);
  }
  close(fd);
  return base == MAP_FAILED ? nullptr : base;
}

// Shared (not process-private) futex operations: the word lives in a mapping that
// other processes share. Elsewhere than Linux a sleep is a short nap.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, int timeout_us) {
  timespec ts{};
  ts.tv_sec = timeout_us / 1000000;
  ts.tv_nsec = static_cast<long>(timeout_us % 1000000) * 1000L;
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr,
          0);
#else
  (void)word;
  (void)expected;
  ts.tv_sec = 0;
  ts.tv_nsec = 50000L;
  nanosleep(&ts, nullptr);
#endif
}

void futex_wake(std::atomic<std::uint32_t>* word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// Rings `c`'s doorbell if its owner sleeps. The caller's last store (a counter) and
// the fence order against the owner's `sleeping` store and fence in sleep_unless():
// either the owner's ready() sees the new counter or this sees it sleeping.
void ring(Control* c) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c->sleeping.load(std::memory_order_relaxed) == 0) return;
  c->bell.fetch_add(1, std::memory_order_release);
  futex_wake(&c->bell);
}

bool all_ranks(MPI_Comm comm, bool mine) {
  int ok = mine ? 1 : 0, all = 0;
  PSG_MPI_CHECK(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, comm), -1);
  return all != 0;
}

}  // namespace

std::unique_ptr<ShmLinks> ShmLinks::create(MPI_Comm comm, std::size_t slot_bytes, int slots,
                                           bool left_on_node, bool right_on_node,
                                           std::string* why_not) {
  int rank = 0, size = 1;
  PSG_MPI_CHECK(MPI_Comm_rank(comm, &rank), -1);
  PSG_MPI_CHECK(MPI_Comm_size(comm, &size), -1);
  // One name per engine: rank 0's process id, the time and a per-process counter.
  static std::atomic<std::uint64_t> engines{0};
  std::uint64_t token = 0;
  if (rank == 0) {
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    token = (static_cast<std::uint64_t>(getpid()) << 32) ^ static_cast<std::uint64_t>(now) ^
            (engines.fetch_add(1) << 56);
  }
  PSG_MPI_CHECK(MPI_Bcast(&token, 1, MPI_UINT64_T, 0, comm), -1);

  std::unique_ptr<ShmLinks> links(new ShmLinks());
  links->slots_ = slots;
  links->in_stride_ = kLine + round_up(slot_bytes);
  const std::string mine = inbox_name(token, rank);
  // Without a left neighbour on this node the inbox is only a doorbell.
  const std::size_t inbox_slots = left_on_node ? static_cast<std::size_t>(slots) : 0;
  const std::size_t inbox_bytes = kControlBytes + inbox_slots * links->in_stride_;
  links->inbox_.base = create_inbox(mine, inbox_bytes, why_not);
  if (links->inbox_.base != nullptr) {
    links->inbox_.bytes = inbox_bytes;
    Control* c = new (links->inbox_.base) Control();
    c->slot_bytes = slot_bytes;
    c->slots = inbox_slots;
  }
  if (!all_ranks(comm, links->inbox_.base != nullptr)) {
    if (links->inbox_.base != nullptr) shm_unlink(mine.c_str());
    if (why_not->empty()) *why_not = "another rank could not create its inbox";
    return nullptr;  // the destructor unmaps
  }
  const std::string right = inbox_name(token, (rank + 1) % size);
  const std::string left = inbox_name(token, (rank + size - 1) % size);
  if (right_on_node) links->outbox_.base = map_inbox(right, &links->outbox_.bytes, why_not);
  if (left_on_node && why_not->empty()) {
    links->left_inbox_.base = map_inbox(left, &links->left_inbox_.bytes, why_not);
  }
  bool mapped = (links->outbox_.base != nullptr) == right_on_node &&
                (links->left_inbox_.base != nullptr) == left_on_node;
  if (mapped && right_on_node) {
    const Control* c = control(links->outbox_.base);
    links->out_capacity_ = c->slot_bytes;
    links->out_stride_ = kLine + round_up(c->slot_bytes);
    mapped = static_cast<int>(c->slots) == slots &&
             kControlBytes + c->slots * links->out_stride_ <= links->outbox_.bytes;
    if (!mapped) *why_not = "the right neighbour's inbox has another layout";
  }
  // Every rank has mapped its neighbours' inboxes once this returns, so the
  // names can go: nothing is left behind in /dev/shm, whatever happens later.
  const bool ok = all_ranks(comm, mapped);
  shm_unlink(mine.c_str());
  if (!ok) {
    if (why_not->empty()) *why_not = "another rank could not map its right neighbour's inbox";
    return nullptr;
  }
  return links;
}

ShmLinks::~ShmLinks() {
  if (inbox_.base != nullptr) munmap(inbox_.base, inbox_.bytes);
  if (outbox_.base != nullptr) munmap(outbox_.base, outbox_.bytes);
  if (left_inbox_.base != nullptr) munmap(left_inbox_.base, left_inbox_.bytes);
}

bool ShmLinks::can_send() const {
  const std::uint64_t released = control(outbox_.base)->tail.load(std::memory_order_acquire);
  return sent_ - released < static_cast<std::uint64_t>(slots_);
}

void ShmLinks::send(const ShmMessage& message, const void* data) {
  unsigned char* slot = slot_at(outbox_.base, out_stride_, sent_, slots_);
  std::memcpy(slot, &message, sizeof message);
  if (message.bytes > 0) std::memcpy(slot + kLine, data, message.bytes);
  ++sent_;
  control(outbox_.base)->head.store(sent_, std::memory_order_release);
  ring(control(outbox_.base));
}

const ShmMessage* ShmLinks::peek() const {
  if (control(inbox_.base)->head.load(std::memory_order_acquire) <= received_) return nullptr;
  return reinterpret_cast<const ShmMessage*>(slot_at(inbox_.base, in_stride_, received_, slots_));
}

const unsigned char* ShmLinks::peek_data() const {
  return slot_at(inbox_.base, in_stride_, received_, slots_) + kLine;
}

void ShmLinks::release() {
  ++received_;
  control(inbox_.base)->tail.store(received_, std::memory_order_release);
  ring(control(left_inbox_.base));  // the left neighbour may wait for room
}

bool ShmLinks::sleep_unless(const std::function<bool()>& ready, int timeout_us) {
  Control* c = control(inbox_.base);
  const std::uint32_t rung = c->bell.load(std::memory_order_acquire);
  c->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (ready()) {
    c->sleeping.store(0, std::memory_order_relaxed);
    return true;
  }
  futex_wait(&c->bell, rung, timeout_us);
  c->sleeping.store(0, std::memory_order_relaxed);
  return false;
}

void ShmLinks::wake_self() {
  Control* c = control(inbox_.base);
  c->bell.fetch_add(1, std::memory_order_release);
  futex_wake(&c->bell);
}

}  // namespace pipesgd
