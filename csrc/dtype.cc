#include "dtype.h"

#include <stdexcept>

namespace pipesgd {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
  }
  throw std::invalid_argument("unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "average"; }

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kNone: return "none";
    case Compression::kTrunc16: return "trunc16";
    case Compression::kQuant8: return "quant8";
  }
  return "unknown";
}

DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float64") return DType::kFloat64;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  throw std::invalid_argument("unsupported dtype '" + name +
                              "': expected float32, float64, float16 or bfloat16");
}

ReduceOp parse_reduce_op(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "average") return ReduceOp::kAverage;
  throw std::invalid_argument("unknown op '" + name + "': expected 'average' or 'sum'");
}

Compression parse_compression(const std::string& name) {
  if (name == "none") return Compression::kNone;
  if (name == "trunc16") return Compression::kTrunc16;
  if (name == "quant8") return Compression::kQuant8;
  throw std::invalid_argument("unknown compression '" + name +
                              "': expected 'none', 'trunc16' or 'quant8'");
}

}  // namespace pipesgd
