// zerocore-bench adam: zerocore::adam_step per SIMD path and thread count, against the roofline of the
// Adam-shaped stream probe measured in the same run on the same number of elements.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "zerocore/cpu_adam.hpp"
#include "zerocore/simd.hpp"
#include "zerocore/stream_probe.hpp"
#include "zerocore/thread_pool.hpp"

namespace zerocore_bench {
namespace {

using zerocore::ScalarType;

// Partition grain for first-touching the Adam buffers. adam_step hands each thread one contiguous, nearly
// equal range; balanced ranges of whole 4 KiB pages put each page within a page of its owner's range.
constexpr int64_t kFirstTouchGrain = 1024;

int64_t type_bytes(ScalarType type) { return type == ScalarType::kFloat32 ? 4 : 2; }

ScalarType parse_type(const std::string& name) {
  if (name == "fp32") return ScalarType::kFloat32;
  return name == "bf16" ? ScalarType::kBFloat16 : ScalarType::kFloat16;
}

uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

uint16_t to_bf16(float value) {  // round to nearest even; the values here are finite
  const uint32_t bits = float_bits(value);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// Exact only for values that fp16 represents as normal numbers, which is all the harness feeds it.
uint16_t to_fp16_exact(float value) {
  const uint32_t bits = float_bits(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xFFu) - 127;
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(exponent + 15) << 10 | ((bits & 0x7FFFFFu) >> 13));
}

// Deterministic, varied, normal values: gradients (2k - 1023) * 2^-12 (never 0, exact in fp16 and fp32),
// params 1 + k * 2^-10, with k cycling through 0..1023.
float grad_value(int64_t i) { return static_cast<float>(2 * (i & 1023) - 1023) * (1.0f / 4096.0f); }
float param_value(int64_t i) { return 1.0f + static_cast<float>(i & 1023) * (1.0f / 1024.0f); }

struct AdamBuffers {
  zerocore::AlignedBuffer param, grad, exp_avg, exp_avg_sq, param_out;
  zerocore::AdamSpans spans;
};

// Allocates and first-touches the spans on `pool`, so each thread's pages sit where it will stream them.
AdamBuffers make_buffers(int64_t n, ScalarType grad_type, bool has_param_out, ScalarType param_out_type,
                         zerocore::ThreadPool& pool) {
  AdamBuffers b;
  const size_t count = static_cast<size_t>(n);
  b.param = zerocore::AlignedBuffer(count * sizeof(float));
  b.grad = zerocore::AlignedBuffer(count * type_bytes(grad_type));
  b.exp_avg = zerocore::AlignedBuffer(count * sizeof(float));
  b.exp_avg_sq = zerocore::AlignedBuffer(count * sizeof(float));
  if (has_param_out) b.param_out = zerocore::AlignedBuffer(count * type_bytes(param_out_type));
  b.spans.param = b.param.as<float>();
  b.spans.grad = b.grad.data();
  b.spans.grad_type = grad_type;
  b.spans.exp_avg = b.exp_avg.as<float>();
  b.spans.exp_avg_sq = b.exp_avg_sq.as<float>();
  b.spans.param_out = has_param_out ? b.param_out.data() : nullptr;
  b.spans.param_out_type = param_out_type;
  b.spans.n = n;
  pool.parallel_for(n, kFirstTouchGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      b.spans.param[i] = param_value(i);
      b.spans.exp_avg[i] = 0.0f;
      b.spans.exp_avg_sq[i] = 0.0f;
      const float g = grad_value(i);
      switch (grad_type) {
        case ScalarType::kFloat32: b.grad.as<float>()[i] = g; break;
        case ScalarType::kBFloat16: b.grad.as<uint16_t>()[i] = to_bf16(g); break;
        case ScalarType::kFloat16: b.grad.as<uint16_t>()[i] = to_fp16_exact(g); break;
      }
      if (has_param_out) b.param_out.as<uint16_t>()[i] = 0;
    }
  });
  return b;
}

std::vector<zerocore::SimdPath> paths_to_run(const std::string& choice) {
  std::vector<zerocore::SimdPath> runnable;
  for (zerocore::SimdPath path : zerocore::compiled_simd_paths()) {
    if (zerocore::cpu_supports(path)) runnable.push_back(path);
  }
  if (choice == "all") return runnable;
  if (choice == "auto") return {zerocore::best_simd_path()};
  const zerocore::SimdPath path = zerocore::parse_simd_path(choice);
  for (zerocore::SimdPath p : runnable) {
    if (p == path) return {path};
  }
  throw UsageError("--path " + choice + " is not available in this build or on this CPU");
}

// The adam-shaped stream at one thread count, with the store kind that reached the most bandwidth.
struct Roofline {
  zerocore::StoreKind stores = zerocore::StoreKind::kRegular;
  double best_gbps = 0.0;
  double median_gbps = 0.0;
};

struct AdamRow {
  int64_t threads;
  zerocore::SimdPath path;
  Timing timing;
  Roofline roofline;
};

}  // namespace

int adam_command(int argc, char** argv) {
  int64_t elements = 100000000;
  std::vector<int64_t> threads{default_threads()};
  std::string grad_name = "fp32";
  std::string param_out_name = "none";
  std::string path_name = "auto";
  int64_t repeat = 10;
  bool json = false;
  ArgParser parser("adam",
                   "Times zerocore::adam_step (AdamW, bias correction on) and, interleaved with its steps on the same\n"
                   "size, the Adam-shaped stream probe. GB/s counts the bytes Adam really moves for the dtypes: fp32\n"
                   "param 4+4, exp_avg 4+4, exp_avg_sq 4+4, grad 4 or 2 read, param_out 2 written. The fraction\n"
                   "is best adam GB/s over the stream's best GB/s (the faster of regular and nt stores).");
  parser.add_int("elements", &elements, 1, "elements per span");
  parser.add_int_list("threads", &threads, 1, "thread counts to measure, e.g. 1,2", kMaxThreads);
  parser.add_choice("grad", &grad_name, {"fp32", "bf16", "fp16"}, "gradient dtype");
  parser.add_choice("param-out", &param_out_name, {"none", "bf16", "fp16"}, "low-precision param copy written");
  parser.add_choice("path", &path_name, {"auto", "scalar", "avx2", "avx512", "all"},
                    "SIMD path; auto = the widest this CPU runs, all = every runnable one");
  parser.add_int("repeat", &repeat, 1, "timed steps per measurement, after one warm-up step", "", kMaxRepeat);
  parser.add_flag("json", &json, "print one JSON object on stdout instead of the table");
  if (!parser.parse(argc, argv, 1)) return 0;

  // Far beyond any machine's memory, and keeps bytes_per_step * elements inside int64.
  if (elements > (int64_t{1} << 50)) throw UsageError("--elements is too large: " + std::to_string(elements));
  const ScalarType grad_type = parse_type(grad_name);
  const bool has_param_out = param_out_name != "none";
  const ScalarType param_out_type = has_param_out ? parse_type(param_out_name) : ScalarType::kBFloat16;
  const std::vector<zerocore::SimdPath> paths = paths_to_run(path_name);
  const int64_t bytes_per_element =
      3 * (4 + 4) + type_bytes(grad_type) + (has_param_out ? type_bytes(param_out_type) : 0);
  const int64_t bytes_per_step = bytes_per_element * elements;

  zerocore::AdamHyper hyper;
  hyper.weight_decay = 0.01;
  auto timed_step = [&](const zerocore::AdamSpans& spans, zerocore::ThreadPool& pool, zerocore::SimdPath path) {
    const auto start = std::chrono::steady_clock::now();
    zerocore::adam_step(spans, hyper, &pool, path);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++hyper.step;  // bias correction changes every step, as in training
    return seconds;
  };
  const int64_t stream_bytes = elements * zerocore::stream_kernel_bytes_per_element(zerocore::StreamKernel::kAdam);

  std::vector<AdamRow> rows;
  for (int64_t thread_count : threads) {
    zerocore::ThreadPool pool(static_cast<int>(thread_count));
    zerocore::StreamProbe probe(elements, &pool);
    std::vector<zerocore::StoreKind> stores{zerocore::StoreKind::kRegular};
    if (zerocore::stream_supports_non_temporal(probe.path())) stores.push_back(zerocore::StoreKind::kNonTemporal);
    AdamBuffers buffers = make_buffers(elements, grad_type, has_param_out, param_out_type, pool);

    // Probe passes and Adam steps alternate, one warm-up round first, so that the roofline and the kernel
    // see the same machine: measured one after the other on a shared host they drift apart.
    std::vector<Timing> stream_timings(stores.size());
    std::vector<Timing> adam_timings(paths.size());
    for (int64_t round = -1; round < repeat; ++round) {
      for (size_t s = 0; s < stores.size(); ++s) {
        const double seconds = probe.time_pass(zerocore::StreamKernel::kAdam, stores[s]);
        if (round >= 0) stream_timings[s].seconds.push_back(seconds);
      }
      for (size_t p = 0; p < paths.size(); ++p) {
        const double seconds = timed_step(buffers.spans, pool, paths[p]);
        if (round >= 0) adam_timings[p].seconds.push_back(seconds);
      }
    }
    Roofline roofline;
    for (size_t s = 0; s < stores.size(); ++s) {
      const double best_gbps = stream_bytes / stream_timings[s].best() * 1e-9;
      if (best_gbps > roofline.best_gbps) {
        roofline = Roofline{stores[s], best_gbps, stream_bytes / stream_timings[s].median() * 1e-9};
      }
    }
    for (size_t p = 0; p < paths.size(); ++p) {
      rows.push_back(AdamRow{thread_count, paths[p], adam_timings[p], roofline});
    }
  }

  auto gbps = [&](double seconds) { return seconds > 0 ? bytes_per_step / seconds * 1e-9 : 0.0; };
  if (json) {
    JsonWriter out;
    out.begin_object()
        .field_string("command", "adam")
        .field_int("elements", elements)
        .field_string("grad", grad_name)
        .field_string("param_out", param_out_name)
        .field_int("bytes_per_element", bytes_per_element)
        .field_int("bytes_per_step", bytes_per_step)
        .field_int("repeat", repeat)
        .field_int("hardware_threads", default_threads())
        .begin_array("results");
    for (const AdamRow& row : rows) {
      out.begin_object()
          .field_int("threads", row.threads)
          .field_string("path", zerocore::simd_path_name(row.path))
          .field_number("best_seconds", row.timing.best())
          .field_number("median_seconds", row.timing.median())
          .field_number("best_gbps", gbps(row.timing.best()))
          .field_number("median_gbps", gbps(row.timing.median()))
          .field_number("roofline_gbps", row.roofline.best_gbps)
          .field_number("roofline_median_gbps", row.roofline.median_gbps)
          .field_string("roofline_stores", zerocore::store_kind_name(row.roofline.stores))
          .field_number("fraction_of_roofline", gbps(row.timing.best()) / row.roofline.best_gbps)
          .end_object();
    }
    out.end_array().end_object();
    std::printf("%s\n", out.str().c_str());
    return 0;
  }

  std::printf("adam: %lld elements, grad %s, param_out %s: %lld bytes/element, %.1f MB per step\n",
              static_cast<long long>(elements), grad_name.c_str(), param_out_name.c_str(),
              static_cast<long long>(bytes_per_element), bytes_per_step * 1e-6);
  std::printf("roofline: the adam-shaped stream (28 B/element, faster store kind), its passes interleaved with\n"
              "the steps; %lld rounds after a warm-up round; fraction = best GB/s / best roofline GB/s\n\n",
              static_cast<long long>(repeat));
  Table table({"threads", "path", "best ms", "median ms", "best GB/s", "median GB/s", "roofline GB/s", "stores",
               "fraction"});
  for (const AdamRow& row : rows) {
    table.add_row({std::to_string(row.threads), zerocore::simd_path_name(row.path),
                   format("%.2f", row.timing.best() * 1e3), format("%.2f", row.timing.median() * 1e3),
                   format("%.2f", gbps(row.timing.best())), format("%.2f", gbps(row.timing.median())),
                   format("%.2f", row.roofline.best_gbps), zerocore::store_kind_name(row.roofline.stores),
                   format("%.3f", gbps(row.timing.best()) / row.roofline.best_gbps)});
  }
  table.print(stdout);
  return 0;
}

}  // namespace zerocore_bench
