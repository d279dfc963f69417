#include "shm_links.h"

#include <sys/mman.h>

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
  alignas(kPair) BellWord bell;                       // neighbours ring it
  alignas(kPair) std::uint64_t slot_bytes = 0;
  std::uint64_t slots = 0;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory counters must be lock-free to work across processes");
static_assert(sizeof(ShmMessage) <= kLine, "a slot's message header fits one line");

constexpr std::size_t round_up(std::size_t x) { return (x + kLine - 1) / kLine * kLine; }
constexpr std::size_t kControlBytes = round_up(sizeof(Control));

Control* control(void* base) { return static_cast<Control*>(base); }
unsigned char* slot_at(void* base, std::size_t stride, std::uint64_t index, int slots) {
  return static_cast<unsigned char*>(base) + kControlBytes +
         static_cast<std::size_t>(index % static_cast<std::uint64_t>(slots)) * stride;
}

}  // namespace

std::unique_ptr<ShmLinks> ShmLinks::create(MPI_Comm comm, std::size_t slot_bytes, int slots,
                                           bool left_on_node, bool right_on_node,
                                           std::string* why_not) {
  int rank = 0, size = 1;
  PSG_MPI_CHECK(MPI_Comm_rank(comm, &rank), -1);
  PSG_MPI_CHECK(MPI_Comm_size(comm, &size), -1);
  const std::uint64_t token = shared_region_token(comm);

  std::unique_ptr<ShmLinks> links(new ShmLinks());
  links->slots_ = slots;
  links->in_stride_ = kLine + round_up(slot_bytes);
  const std::string mine = shared_region_name(token, "inbox", rank);
  // Without a left neighbour on this node the inbox is only a doorbell.
  const std::size_t inbox_slots = left_on_node ? static_cast<std::size_t>(slots) : 0;
  const std::size_t inbox_bytes = kControlBytes + inbox_slots * links->in_stride_;
  links->inbox_.base = create_shared_region(mine, inbox_bytes, why_not);
  if (links->inbox_.base != nullptr) {
    links->inbox_.bytes = inbox_bytes;
    Control* c = new (links->inbox_.base) Control();
    c->slot_bytes = slot_bytes;
    c->slots = inbox_slots;
  }
  if (!on_all_ranks(comm, links->inbox_.base != nullptr)) {
    if (links->inbox_.base != nullptr) shm_unlink(mine.c_str());
    if (why_not->empty()) *why_not = "another rank could not create its inbox";
    return nullptr;  // the destructor unmaps
  }
  const std::string right = shared_region_name(token, "inbox", (rank + 1) % size);
  const std::string left = shared_region_name(token, "inbox", (rank + size - 1) % size);
  if (right_on_node) {
    links->outbox_.base = map_shared_region(right, &links->outbox_.bytes, why_not);
  }
  if (left_on_node && why_not->empty()) {
    links->left_inbox_.base = map_shared_region(left, &links->left_inbox_.bytes, why_not);
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
  const bool ok = on_all_ranks(comm, mapped);
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
  ring_bell(&control(outbox_.base)->bell);
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
  ring_bell(&control(left_inbox_.base)->bell);  // the left neighbour may wait for room
}

bool ShmLinks::sleep_unless(const std::function<bool()>& ready, int timeout_us) {
  return sleep_on_bell(&control(inbox_.base)->bell, ready, timeout_us);
}

void ShmLinks::wake_self() { wake_bell(&control(inbox_.base)->bell); }

}  // namespace pipesgd
