#include "allreduce/wire_codec.h"

#include <cstdint>

#include "compress/kernels.h"

namespace pipesgd {
namespace {

class Trunc16Codec final : public WireCodec {
 public:
  std::size_t wire_bytes(std::size_t n) const override { return psg_trunc16_wire_bytes(n); }
  void encode(const float* x, std::size_t n, void* wire) const override {
    psg_trunc16_encode(x, n, static_cast<std::uint16_t*>(wire));
  }
  void decode(const void* wire, std::size_t n, float factor, float* out) const override {
    psg_trunc16_decode_scaled(static_cast<const std::uint16_t*>(wire), n, factor, out);
  }
  void decode_add_encode(const void* in_wire, const float* local, std::size_t n, float*,
                         void* out_wire) const override {
    psg_trunc16_decode_add_encode(static_cast<const std::uint16_t*>(in_wire), local, n,
                                  static_cast<std::uint16_t*>(out_wire));
  }
  void decode_add_encode_decode(const void* in_wire, float* local, std::size_t n, float factor,
                                void* out_wire) const override {
    psg_trunc16_decode_add_encode_decode(static_cast<const std::uint16_t*>(in_wire), local, n,
                                         factor, static_cast<std::uint16_t*>(out_wire));
  }
};

class Quant8Codec final : public WireCodec {
 public:
  std::size_t wire_bytes(std::size_t n) const override { return psg_quant8_wire_bytes(n); }
  void encode(const float* x, std::size_t n, void* wire) const override {
    psg_quant8_encode(x, n, wire);
  }
  void decode(const void* wire, std::size_t n, float factor, float* out) const override {
    psg_quant8_decode_scaled(wire, n, factor, out);
  }
  void decode_add_encode(const void* in_wire, const float* local, std::size_t n, float* scratch,
                         void* out_wire) const override {
    psg_quant8_decode_add_encode(in_wire, local, n, scratch, out_wire);
  }
  void decode_add_encode_decode(const void* in_wire, float* local, std::size_t n, float factor,
                                void* out_wire) const override {
    psg_quant8_decode_add_encode_decode(in_wire, local, n, factor, out_wire);
  }
};

}  // namespace

std::unique_ptr<WireCodec> make_wire_codec(Compression c) {
  switch (c) {
    case Compression::kNone: return nullptr;
    case Compression::kTrunc16: return std::make_unique<Trunc16Codec>();
    case Compression::kQuant8: return std::make_unique<Quant8Codec>();
  }
  return nullptr;
}

}  // namespace pipesgd
