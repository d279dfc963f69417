// Buffers the ring reuses across operations, so a steady training loop
// allocates (and page-faults) nothing per call.
#pragma once

#include <cstddef>
#include <vector>

namespace pipesgd {

class Workspace {
 public:
  // Returns at least `bytes` bytes of `which` buffer, grown only when needed.
  unsigned char* receive_slots(std::size_t bytes) { return grow(slots_, bytes); }
  unsigned char* wire(std::size_t bytes) { return grow(wire_, bytes); }
  float* scratch(std::size_t floats) {
    if (scratch_.size() < floats) scratch_.resize(floats);
    return scratch_.data();
  }

 private:
  // 64-byte aligned storage: every slot and wire area starts on a cache line.
  struct alignas(64) Line {
    unsigned char bytes[64];
  };
  static unsigned char* grow(std::vector<Line>& buf, std::size_t bytes) {
    const std::size_t lines = (bytes + sizeof(Line) - 1) / sizeof(Line);
    if (buf.size() < lines) {
      buf.clear();
      buf.shrink_to_fit();
      buf.resize(lines);
    }
    return reinterpret_cast<unsigned char*>(buf.data());
  }

  std::vector<Line> slots_;
  std::vector<Line> wire_;
  std::vector<float> scratch_;
};

}  // namespace pipesgd
