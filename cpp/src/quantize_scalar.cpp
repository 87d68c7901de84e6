// The portable quantization kernels: plain C++ compiled without ISA flags. q is the exact quotient rounded
// half to even: x / scale in double is within 2^-46 of the real quotient, which is either exactly a
// half-integer or at least 2^-25 away from one (x and scale are fp32), so rounding the double rounds the
// real quotient. The rounding itself is the 1.5 * 2^52 trick (exact for |q| < 2^51, round-to-nearest-even
// in the default FP environment), which the compiler can vectorise, unlike nearbyint.
#include <cstdint>
#include <cstring>

#include "quantize_kernels.hpp"

namespace zerocore {
namespace kernels {
namespace {

constexpr double kRoundMagic = 6755399441055744.0;  // 1.5 * 2^52

inline int32_t round_half_even(double value) {
  return static_cast<int32_t>((value + kRoundMagic) - kRoundMagic);
}

template <ScalarType kIn>
QuantizeResult quantize_groups(const QuantizeArgs& args, int64_t group_begin, int64_t group_end) {
  const int qmax = quantize_qmax(args.bits);
  QuantizeResult result;
  for (int64_t g = group_begin; g < group_end; ++g) {
    const GroupRange range = group_range(args.n, args.group_size, g);
    uint32_t absmax_bits = 0;
    for (int64_t i = range.begin; i < range.end; ++i) {
      absmax_bits = std::max(absmax_bits, float_bits(load_as_float<kIn>(args.input, i)) & kF32AbsMask);
    }
    if (absmax_bits >= kF32ExponentMask) {
      flag_nonfinite_group<kIn>(args, g, range, result);
      continue;
    }
    const float scale = group_scale(absmax_bits, qmax);
    if (scale == 0.0f) {
      write_zero_group(args, g, range);
      continue;
    }
    args.scales[g] = scale;
    const double divisor = scale;
    uint8_t* const q = args.q + q_byte_offset(args.bits, range.begin);
    if (args.bits == 8) {
      for (int64_t i = range.begin; i < range.end; ++i) {
        q[i - range.begin] = static_cast<uint8_t>(round_half_even(load_as_float<kIn>(args.input, i) / divisor));
      }
    } else {
      for (int64_t i = range.begin; i < range.end; i += 2) {
        const int32_t low = round_half_even(load_as_float<kIn>(args.input, i) / divisor);
        const int32_t high = i + 1 < range.end ? round_half_even(load_as_float<kIn>(args.input, i + 1) / divisor) : 0;
        q[(i - range.begin) / 2] = static_cast<uint8_t>((low & 0xF) | ((high & 0xF) << 4));
      }
    }
  }
  return result;
}

template <ScalarType kOut>
void dequantize_groups(const DequantizeArgs& args, int64_t group_begin, int64_t group_end) {
  for (int64_t g = group_begin; g < group_end; ++g) dequantize_group_scalar<kOut>(args, g);
}

}  // namespace

QuantizeResult quantize_groups_scalar(const QuantizeArgs& args, int64_t group_begin, int64_t group_end) {
  switch (args.in_type) {
    case ScalarType::kFloat32: return quantize_groups<ScalarType::kFloat32>(args, group_begin, group_end);
    case ScalarType::kBFloat16: return quantize_groups<ScalarType::kBFloat16>(args, group_begin, group_end);
    case ScalarType::kFloat16: return quantize_groups<ScalarType::kFloat16>(args, group_begin, group_end);
  }
  return {};
}

void dequantize_groups_scalar(const DequantizeArgs& args, int64_t group_begin, int64_t group_end) {
  switch (args.out_type) {
    case ScalarType::kFloat32: return dequantize_groups<ScalarType::kFloat32>(args, group_begin, group_end);
    case ScalarType::kBFloat16: return dequantize_groups<ScalarType::kBFloat16>(args, group_begin, group_end);
    case ScalarType::kFloat16: return dequantize_groups<ScalarType::kFloat16>(args, group_begin, group_end);
  }
}

}  // namespace kernels
}  // namespace zerocore
