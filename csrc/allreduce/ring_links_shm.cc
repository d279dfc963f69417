// Ring edges through shared-memory links (shm_links.h): a send is queued and copied
// into the right neighbour's inbox whenever it has a free slot, in the order the
// neighbour processes its units; a unit is read straight out of this rank's inbox.
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "allreduce/ring_links.h"

namespace pipesgd {
namespace {

// The step a header travels under, ahead of the data.
constexpr int kHeaderStep = -1;

class ShmRingOut final : public RingOut {
 public:
  ShmRingOut(ShmLinks& links, const Operation& op, int right, const RingLayout& layout)
      : links_(links), op_(op), right_(right), layout_(layout) {
    rs_number_.resize(static_cast<std::size_t>(layout.size()));
    for (int c = 0; c < layout.size(); ++c) {
      rs_number_[static_cast<std::size_t>(c)].assign(layout.segments(c), 0);
    }
  }

  void send_header(const RingHeader& header) override {
    header_ = header;
    queue(Outgoing{kHeaderStep, 0, &header_, sizeof header_});
  }

  void send(int step, int chunk, std::size_t seg, const void* data,
            std::size_t bytes) override {
    if (layout_.is_reduce_scatter(step)) {
      rs_number_[static_cast<std::size_t>(chunk)][seg] = queued_;
    }
    queue(Outgoing{step, seg, data, bytes});
  }

  bool throttles_first_step() const override { return false; }

  // Copies queued sends into the right neighbour's free slots.
  bool progress() override {
    while (!outbox_.empty() && links_.can_send()) {
      const Outgoing& out = outbox_.front();
      if (out.bytes > links_.right_slot_bytes()) {
        throw OpFailure(FailureKind::kMismatch,
                        op_.describe() + ": a segment of " + std::to_string(out.bytes) +
                            " bytes does not fit rank " + std::to_string(right_) +
                            "'s shared-memory slots of " +
                            std::to_string(links_.right_slot_bytes()) +
                            " bytes; every rank must create its engine with the same "
                            "segment_bytes");
      }
      ShmMessage message;
      message.seq = op_.seq;
      message.step = out.step;
      message.segment = out.seg;
      message.bytes = out.bytes;
      links_.send(message, out.data);
      outbox_.pop_front();
      ++copied_;
    }
    return outbox_.empty();
  }

  bool sent(int chunk, std::size_t seg) override {
    return rs_number_[static_cast<std::size_t>(chunk)][seg] < copied_;
  }

  void abandon() noexcept override { outbox_.clear(); }

 private:
  struct Outgoing {
    int step;
    std::size_t seg;
    const void* data;
    std::size_t bytes;
  };

  void queue(const Outgoing& out) {
    outbox_.push_back(out);
    ++queued_;
  }

  ShmLinks& links_;
  const Operation& op_;
  const int right_;
  const RingLayout& layout_;
  RingHeader header_{};
  std::deque<Outgoing> outbox_;
  std::uint64_t queued_ = 0;  // sends queued so far, the header included
  std::uint64_t copied_ = 0;  // of which copied out
  std::vector<std::vector<std::uint64_t>> rs_number_;  // [chunk][segment] -> queue number
};

class ShmRingIn final : public RingIn {
 public:
  ShmRingIn(ShmLinks& links, const Operation& op, int rank, int left)
      : links_(links), op_(op), rank_(rank), left_(left) {}

  void expect_header() override {}
  bool header_arrived() override { return links_.peek() != nullptr; }
  const RingHeader* take_header() override {
    const ShmMessage& first = *links_.peek();
    const bool is_header = first.step == kHeaderStep && first.bytes == sizeof(RingHeader);
    if (is_header) std::memcpy(&theirs_, links_.peek_data(), sizeof theirs_);
    links_.release();
    return is_header ? &theirs_ : nullptr;
  }

  bool lands_when_expected() const override { return false; }
  void expect(std::size_t, const RingUnit&, unsigned char*) override {}
  bool arrived(std::size_t) override { return links_.peek() != nullptr; }

  const unsigned char* take(std::size_t, const RingUnit& unit, unsigned char* home) override {
    check_arrival(*links_.peek(), unit);
    const unsigned char* data = links_.peek_data();
    if (home == nullptr) return data;
    std::memcpy(home, data, unit.bytes);
    return home;
  }
  void release() override { links_.release(); }
  void abandon() noexcept override {}

 private:
  // The headers matched, so a segment that is not the expected one is a defect in
  // the ring, not in the caller's submissions: fail loudly rather than add it.
  void check_arrival(const ShmMessage& m, const RingUnit& unit) const {
    if (m.seq == op_.seq && m.step == unit.step && m.segment == unit.seg &&
        m.bytes == unit.bytes) {
      return;
    }
    throw OpFailure(FailureKind::kMpi,
                    op_.describe() + " on rank " + std::to_string(rank_) +
                        " expected step " + std::to_string(unit.step) + " segment " +
                        std::to_string(unit.seg) + " (" + std::to_string(unit.bytes) +
                        " bytes) from rank " + std::to_string(left_) +
                        " but found allreduce #" + std::to_string(m.seq) + " step " +
                        std::to_string(m.step) + " segment " + std::to_string(m.segment) +
                        " (" + std::to_string(m.bytes) + " bytes) in its shared-memory inbox");
  }
  ShmLinks& links_;
  const Operation& op_;
  const int rank_;
  const int left_;
  RingHeader theirs_{};
};

}  // namespace

std::unique_ptr<RingOut> shm_ring_out(ShmLinks& links, const Operation& op, int right,
                                      const RingLayout& layout) {
  return std::make_unique<ShmRingOut>(links, op, right, layout);
}

std::unique_ptr<RingIn> shm_ring_in(ShmLinks& links, const Operation& op, int rank,
                                    int left) {
  return std::make_unique<ShmRingIn>(links, op, rank, left);
}

}  // namespace pipesgd
