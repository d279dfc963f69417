// Ring edges as MPI messages. Within a step, segments are sent and received in
// increasing order, and MPI keeps messages of one (source, tag) in order, so the n-th
// receive of a step matches the n-th send of that step.
#include <cstdint>
#include <vector>

#include "allreduce/ring_links.h"
#include "mpi_check.h"

namespace pipesgd {
namespace {

// Whether `request` completed (it is then MPI_REQUEST_NULL); MPI progresses meanwhile.
bool request_done(MPI_Request& request, int peer) {
  int done = 0;
  PSG_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE), peer);
  return done != 0;
}

class MpiRingOut final : public RingOut {
 public:
  MpiRingOut(CommContext& ctx, const Operation& op, int right, const RingLayout& layout)
      : ctx_(ctx), op_(op), right_(right), layout_(layout) {
    rs_index_.resize(static_cast<std::size_t>(layout.size()));
    std::size_t total = 0;
    for (int c = 0; c < layout.size(); ++c) {
      rs_index_[static_cast<std::size_t>(c)].assign(layout.segments(c), kNone);
      total += layout.segments(c);
    }
    requests_.reserve(2 * total);
  }

  void send_header(const RingHeader& header) override {
    header_ = header;
    PSG_MPI_CHECK(MPI_Isend(&header_, sizeof header_, MPI_BYTE, right_, ctx_.header_tag(op_.seq),
                            ctx_.comm(), &header_request_),
                  right_);
  }

  void send(int step, int chunk, std::size_t seg, const void* data,
            std::size_t bytes) override {
    if (layout_.is_reduce_scatter(step)) {
      rs_index_[static_cast<std::size_t>(chunk)][seg] = requests_.size();
    }
    requests_.push_back(MPI_REQUEST_NULL);
    PSG_MPI_CHECK(MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, right_,
                            ctx_.data_tag(op_.seq, step), ctx_.comm(), &requests_.back()),
                  right_);
  }

  bool throttles_first_step() const override { return true; }

  // Tests the oldest sends not known complete, up to the first still under way: any test
  // drives MPI's progress, and each request is found complete once.
  bool progress() override {
    while (completed_ < requests_.size() && test(requests_[completed_])) ++completed_;
    return completed_ == requests_.size() && test(header_request_);
  }

  bool sent(int chunk, std::size_t seg) override {
    const std::size_t index = rs_index_[static_cast<std::size_t>(chunk)][seg];
    return index == kNone || index < completed_ || test(requests_[index]);
  }

  void abandon() noexcept override {
    ctx_.release_requests(requests_, /*cancel=*/false);
    std::vector<MPI_Request> header{header_request_};
    ctx_.release_requests(header, false);
  }

 private:
  static constexpr std::size_t kNone = SIZE_MAX;

  bool test(MPI_Request& request) { return request_done(request, right_); }

  CommContext& ctx_;
  const Operation& op_;
  const int right_;
  const RingLayout& layout_;
  RingHeader header_{};
  MPI_Request header_request_ = MPI_REQUEST_NULL;
  std::vector<MPI_Request> requests_;                // every data send, in order
  std::size_t completed_ = 0;                        // requests_[0, completed_) are done
  std::vector<std::vector<std::size_t>> rs_index_;  // [chunk][segment] -> requests_ index
};

class MpiRingIn final : public RingIn {
 public:
  MpiRingIn(CommContext& ctx, const Operation& op, int left, Workspace& ws,
            std::size_t slot_bytes, int window)
      : ctx_(ctx),
        op_(op),
        left_(left),
        slot_bytes_(slot_bytes),
        receives_(static_cast<std::size_t>(window), MPI_REQUEST_NULL),
        slots_(ws.receive_slots(slot_bytes * static_cast<std::size_t>(window))) {}

  void expect_header() override {
    PSG_MPI_CHECK(MPI_Irecv(&theirs_, sizeof theirs_, MPI_BYTE, left_, ctx_.header_tag(op_.seq),
                            ctx_.comm(), &header_request_),
                  left_);
  }
  bool header_arrived() override { return test(header_request_); }
  const RingHeader* take_header() override { return &theirs_; }

  bool lands_when_expected() const override { return true; }

  void expect(std::size_t index, const RingUnit& unit, unsigned char* home) override {
    unsigned char* dst = home != nullptr ? home : slot(index);
    PSG_MPI_CHECK(MPI_Irecv(dst, static_cast<int>(unit.bytes), MPI_BYTE, left_,
                            ctx_.data_tag(op_.seq, unit.step), ctx_.comm(), &request(index)),
                  left_);
  }
  bool arrived(std::size_t index) override { return test(request(index)); }
  const unsigned char* take(std::size_t index, const RingUnit&, unsigned char* home) override {
    return home != nullptr ? home : slot(index);
  }
  void release() override {}

  void abandon() noexcept override {
    ctx_.release_requests(receives_, /*cancel=*/true);
    std::vector<MPI_Request> header{header_request_};
    ctx_.release_requests(header, true);
  }

 private:
  MPI_Request& request(std::size_t index) { return receives_[index % receives_.size()]; }
  unsigned char* slot(std::size_t index) const {
    return slots_ + (index % receives_.size()) * slot_bytes_;
  }
  bool test(MPI_Request& request) { return request_done(request, left_); }

  CommContext& ctx_;
  const Operation& op_;
  const int left_;
  const std::size_t slot_bytes_;
  std::vector<MPI_Request> receives_;  // one per staging slot: `window` posted ahead
  unsigned char* const slots_;
  RingHeader theirs_{};
  MPI_Request header_request_ = MPI_REQUEST_NULL;
};

}  // namespace

std::unique_ptr<RingOut> mpi_ring_out(CommContext& ctx, const Operation& op, int right,
                                      const RingLayout& layout) {
  return std::make_unique<MpiRingOut>(ctx, op, right, layout);
}

std::unique_ptr<RingIn> mpi_ring_in(CommContext& ctx, const Operation& op, int left,
                                    Workspace& ws, std::size_t slot_bytes, int window) {
  return std::make_unique<MpiRingIn>(ctx, op, left, ws, slot_bytes, window);
}

}  // namespace pipesgd
