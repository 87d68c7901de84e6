// zerocore-bench quantize: zerocore::quantize_symmetric and dequantize_symmetric (int8 / int4, fp32 / bf16 /
// fp16 data) per SIMD path and thread count, against two rooflines measured in the same run: the copy stream
// and the stream of the call's own read:write shape (Note [Shaped streams] in zerocore/stream_probe.hpp).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "zerocore/quantize.hpp"
#include "zerocore/simd.hpp"
#include "zerocore/stream_probe.hpp"
#include "zerocore/thread_pool.hpp"

namespace zerocore_bench {
namespace {

using zerocore::ScalarType;

// Partition grain for first-touching the buffers: whole groups near each thread's range.
constexpr int64_t kFirstTouchGrain = 4096;

int64_t type_bytes(ScalarType type) { return type == ScalarType::kFloat32 ? 4 : 2; }

ScalarType parse_type(const std::string& name) {
  if (name == "fp32") return ScalarType::kFloat32;
  return name == "bf16" ? ScalarType::kBFloat16 : ScalarType::kFloat16;
}

// Deterministic, varied, finite data exact in every dtype: (k - 512) * 2^-9 * (1 + (i >> 12 & 7)), so groups
// differ in scale and every group holds both signs.
float data_value(int64_t i) {
  return static_cast<float>((i * 37 & 1023) - 512) * (1.0f / 512.0f) * static_cast<float>(1 + ((i >> 12) & 7));
}

uint16_t to_16bit(float value, ScalarType type) {  // the values above are exact in bf16 and fp16
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (type == ScalarType::kBFloat16) return static_cast<uint16_t>(bits >> 16);
  if (value == 0.0f) return 0;
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xFFu) - 127;
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(exponent + 15) << 10 | ((bits & 0x7FFFFFu) >> 13));
}

// The paths named on the command line, in the order given, each once.
std::vector<zerocore::SimdPath> paths_to_run(const std::vector<std::string>& choices) {
  std::vector<zerocore::SimdPath> runnable;
  for (zerocore::SimdPath path : zerocore::compiled_simd_paths()) {
    if (zerocore::cpu_supports(path)) runnable.push_back(path);
  }
  std::vector<zerocore::SimdPath> paths;
  auto add = [&](zerocore::SimdPath path) {
    for (zerocore::SimdPath p : paths) {
      if (p == path) return;
    }
    paths.push_back(path);
  };
  for (const std::string& choice : choices) {
    if (choice == "all") {
      for (zerocore::SimdPath path : runnable) add(path);
      continue;
    }
    const zerocore::SimdPath path = choice == "auto" ? zerocore::best_simd_path() : zerocore::parse_simd_path(choice);
    bool available = false;
    for (zerocore::SimdPath p : runnable) available = available || p == path;
    if (!available) throw UsageError("--path " + choice + " is not available in this build or on this CPU");
    add(path);
  }
  return paths;
}

// One measured configuration: a direction, bits, the data dtype (input of quantize, output of dequantize).
struct Case {
  bool quantize;
  int bits;
  std::string dtype_name;
  ScalarType dtype;
  zerocore::SimdPath path;
  int64_t bytes;  // read + written by one call
  // Its data bytes per q byte as a stream shape: quantize reads 2-8 lines per line written, dequantize the
  // reverse. The scales (4 bytes per group) are left out of the shape.
  zerocore::StreamShape shape;
};

struct StreamVariant {
  zerocore::StoreKind stores;
  int64_t prefetch_bytes;  // shaped streams only: a software prefetch this far ahead of each line read

  std::string name() const {
    const std::string store = zerocore::store_kind_name(stores);
    return prefetch_bytes > 0 ? store + "+pf" + std::to_string(prefetch_bytes / 1024) + "k" : store;
  }
};

struct Roofline {
  double best_gbps;
  double median_gbps;
  StreamVariant fastest;
};

struct Row {
  int64_t threads;
  Case c;
  Timing timing;
  Roofline copy;
  Roofline shaped;
};

// The buffers of one dtype: the data (input of quantize, output of dequantize) and q/scales for both bits.
struct Buffers {
  zerocore::AlignedBuffer data, q8, q4, scales;
};

Buffers make_buffers(int64_t n, ScalarType type, int64_t group_size, zerocore::ThreadPool& pool) {
  Buffers b;
  b.data = zerocore::AlignedBuffer(static_cast<size_t>(n * type_bytes(type)));
  b.q8 = zerocore::AlignedBuffer(static_cast<size_t>(zerocore::quantized_bytes(n, 8)));
  b.q4 = zerocore::AlignedBuffer(static_cast<size_t>(zerocore::quantized_bytes(n, 4)));
  b.scales = zerocore::AlignedBuffer(static_cast<size_t>(zerocore::quantize_num_groups(n, group_size)) * 4);
  pool.parallel_for(n, kFirstTouchGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = data_value(i);
      if (type == ScalarType::kFloat32) {
        b.data.as<float>()[i] = v;
      } else {
        b.data.as<uint16_t>()[i] = to_16bit(v, type);
      }
      b.q8.as<uint8_t>()[i] = 0;
      if (i % 2 == 0) b.q4.as<uint8_t>()[i / 2] = 0;
      if (i % group_size == 0) b.scales.as<float>()[i / group_size] = 0.0f;
    }
  });
  return b;
}

}  // namespace

int quantize_command(int argc, char** argv) {
  int64_t elements = int64_t{1} << 25;
  int64_t group_size = 2048;
  std::vector<int64_t> threads{default_threads()};
  std::vector<int64_t> bits_list{8, 4};
  std::vector<std::string> dtypes{"fp32", "bf16"};
  std::vector<std::string> directions{"quantize", "dequantize"};
  std::vector<std::string> path_names{"auto"};
  int64_t repeat = 10;
  bool json = false;
  ArgParser parser("quantize",
                   "Times zerocore::quantize_symmetric and dequantize_symmetric (one fp32 scale per group) and,\n"
                   "interleaved with them on the same machine, two rooflines: the copy stream (8 B/element fp32\n"
                   "a = b) and a stream of the call's own shape (quantize reads 2-8 cache lines per line written,\n"
                   "dequantize the reverse; xor only), each the fastest of regular and nt stores (the shaped one\n"
                   "also with no, a 4 KiB or a 16 KiB software prefetch). GB/s counts the bytes each call reads\n"
                   "plus writes: quantize reads the data (4 or 2 B/element) and writes q (1 or 0.5 B) and the\n"
                   "scales; dequantize the reverse. The fractions are best GB/s over each roofline's best GB/s;\n"
                   "the shaped one is the memory roofline of the call's traffic.");
  parser.add_int("elements", &elements, 1, "elements quantized per call");
  parser.add_int("group-size", &group_size, 2, "elements per scale (even, for int4)");
  parser.add_int_list("threads", &threads, 1, "thread counts to measure, e.g. 1,2", kMaxThreads);
  parser.add_int_list("bits", &bits_list, 4, "8 and/or 4");
  parser.add_choice_list("dtype", &dtypes, {"fp32", "bf16", "fp16"},
                         "data dtypes: quantize's input, dequantize's output");
  parser.add_choice_list("direction", &directions, {"quantize", "dequantize"}, "what to time");
  parser.add_choice_list("path", &path_names, {"auto", "scalar", "avx2", "avx512", "all"},
                         "SIMD paths, e.g. avx2,avx512; auto = the widest this CPU runs, all = every runnable one");
  parser.add_int("repeat", &repeat, 1, "timed calls per measurement, after one warm-up round", "", kMaxRepeat);
  parser.add_flag("json", &json, "print one JSON object on stdout instead of the table");
  if (!parser.parse(argc, argv, 1)) return 0;

  if (elements > (int64_t{1} << 40)) throw UsageError("--elements is too large: " + std::to_string(elements));
  if (group_size % 2 != 0) throw UsageError("--group-size must be even (int4 packs two values per byte)");
  for (int64_t bits : bits_list) {
    if (bits != 8 && bits != 4) throw UsageError("--bits takes 8 and/or 4, got " + std::to_string(bits));
  }
  const std::vector<zerocore::SimdPath> paths = paths_to_run(path_names);
  const int64_t groups = zerocore::quantize_num_groups(elements, group_size);

  std::vector<Case> cases;
  for (const std::string& direction : directions) {
    for (int64_t bits : bits_list) {
      for (const std::string& dtype_name : dtypes) {
        for (zerocore::SimdPath path : paths) {
          const ScalarType dtype = parse_type(dtype_name);
          const int64_t bytes = elements * type_bytes(dtype) +
                                zerocore::quantized_bytes(elements, static_cast<int>(bits)) + groups * 4;
          const int ratio = static_cast<int>(type_bytes(dtype) * 8 / bits);
          const zerocore::StreamShape shape =
              direction == "quantize" ? zerocore::StreamShape{ratio, 1} : zerocore::StreamShape{1, ratio};
          cases.push_back(
              Case{direction == "quantize", static_cast<int>(bits), dtype_name, dtype, path, bytes, shape});
        }
      }
    }
  }

  std::vector<Row> rows;
  // The streams run over at least one narrow line of the widest shape (8:1, 128 fp32), so a tiny --elements
  // still has a shaped roofline (in cache either way).
  const int64_t stream_elements = std::max<int64_t>(elements, 128);
  const int64_t copy_bytes =
      stream_elements * zerocore::stream_kernel_bytes_per_element(zerocore::StreamKernel::kCopy);
  for (int64_t thread_count : threads) {
    zerocore::ThreadPool pool(static_cast<int>(thread_count));
    zerocore::StreamProbe probe(stream_elements, &pool);
    std::vector<zerocore::StoreKind> stores{zerocore::StoreKind::kRegular};
    if (zerocore::stream_supports_non_temporal(probe.path())) stores.push_back(zerocore::StoreKind::kNonTemporal);
    std::vector<Buffers> buffers;
    for (const std::string& dtype_name : dtypes) {
      buffers.push_back(make_buffers(elements, parse_type(dtype_name), group_size, pool));
    }
    auto buffers_of = [&](const Case& c) -> Buffers& {
      for (size_t d = 0; d < dtypes.size(); ++d) {
        if (dtypes[d] == c.dtype_name) return buffers[d];
      }
      return buffers[0];
    };
    // Quantize once first, so dequantize reads real q and scales whatever the order of the cases.
    for (const Case& c : cases) {
      Buffers& b = buffers_of(c);
      zerocore::quantize_symmetric(b.data.data(), c.dtype, elements, c.bits, group_size,
                                   (c.bits == 8 ? b.q8 : b.q4).as<uint8_t>(), b.scales.as<float>(), &pool, c.path);
    }
    auto run_case = [&](const Case& c) {
      Buffers& b = buffers_of(c);
      uint8_t* const q = (c.bits == 8 ? b.q8 : b.q4).as<uint8_t>();
      const auto start = std::chrono::steady_clock::now();
      if (c.quantize) {
        const zerocore::QuantizeResult result = zerocore::quantize_symmetric(
            b.data.data(), c.dtype, elements, c.bits, group_size, q, b.scales.as<float>(), &pool, c.path);
        if (!result.ok()) throw std::runtime_error("the benchmark's data held a non-finite value");
      } else {
        zerocore::dequantize_symmetric(q, b.scales.as<float>(), elements, c.bits, group_size, b.data.data(), c.dtype,
                                       &pool, c.path);
      }
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };

    // The shapes the cases need, each once; index 0 of the streams is the copy, then one per shape.
    std::vector<zerocore::StreamShape> shapes;
    std::vector<size_t> shape_of_case;
    for (const Case& c : cases) {
      const auto at = std::find(shapes.begin(), shapes.end(), c.shape);
      shape_of_case.push_back(static_cast<size_t>(at - shapes.begin()));
      if (at == shapes.end()) shapes.push_back(c.shape);
    }
    // Each stream runs with every store kind; the shaped ones also with a software prefetch 4 or 16 KiB
    // ahead (the quantize kernels prefetch 4 KiB ahead: the roofline must not be beatable by prefetching).
    std::vector<StreamVariant> copy_variants, shaped_variants;
    for (zerocore::StoreKind store : stores) {
      copy_variants.push_back(StreamVariant{store, 0});
      for (int64_t prefetch_bytes : {0, 4096, 16384}) shaped_variants.push_back(StreamVariant{store, prefetch_bytes});
    }
    auto variants_of = [&](size_t stream) -> const std::vector<StreamVariant>& {
      return stream == 0 ? copy_variants : shaped_variants;
    };
    auto time_stream = [&](size_t stream, StreamVariant variant) {
      return stream == 0 ? probe.time_pass(zerocore::StreamKernel::kCopy, variant.stores)
                         : probe.time_shaped_pass(shapes[stream - 1], variant.stores, variant.prefetch_bytes);
    };
    auto stream_bytes_of = [&](size_t stream) {
      return stream == 0 ? copy_bytes : probe.shaped_pass_bytes(shapes[stream - 1]);
    };

    // Stream passes and kernel calls alternate, one warm-up round first, so that the rooflines and the
    // kernels see the same machine: measured one after the other on a shared host they drift apart.
    std::vector<std::vector<Timing>> stream_timings;
    for (size_t stream = 0; stream < 1 + shapes.size(); ++stream) {
      stream_timings.emplace_back(variants_of(stream).size());
    }
    std::vector<Timing> case_timings(cases.size());
    for (int64_t round = -1; round < repeat; ++round) {
      for (size_t stream = 0; stream < stream_timings.size(); ++stream) {
        for (size_t v = 0; v < variants_of(stream).size(); ++v) {
          const double seconds = time_stream(stream, variants_of(stream)[v]);
          if (round >= 0) stream_timings[stream][v].seconds.push_back(seconds);
        }
      }
      for (size_t k = 0; k < cases.size(); ++k) {
        const double seconds = run_case(cases[k]);
        if (round >= 0) case_timings[k].seconds.push_back(seconds);
      }
    }
    auto roofline_of = [&](size_t stream) {
      const std::vector<Timing>& timings = stream_timings[stream];
      size_t fastest = 0;
      for (size_t v = 1; v < timings.size(); ++v) {
        if (timings[v].best() < timings[fastest].best()) fastest = v;
      }
      const double bytes = static_cast<double>(stream_bytes_of(stream));
      return Roofline{bytes / timings[fastest].best() * 1e-9, bytes / timings[fastest].median() * 1e-9,
                      variants_of(stream)[fastest]};
    };
    const Roofline copy = roofline_of(0);
    for (size_t k = 0; k < cases.size(); ++k) {
      rows.push_back(Row{thread_count, cases[k], case_timings[k], copy, roofline_of(1 + shape_of_case[k])});
    }
  }

  auto gbps = [](int64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds * 1e-9 : 0.0; };
  if (json) {
    JsonWriter out;
    out.begin_object()
        .field_string("command", "quantize")
        .field_int("elements", elements)
        .field_int("group_size", group_size)
        .field_int("repeat", repeat)
        .field_int("hardware_threads", default_threads())
        .begin_array("results");
    for (const Row& row : rows) {
      const double best = gbps(row.c.bytes, row.timing.best());
      out.begin_object()
          .field_int("threads", row.threads)
          .field_string("direction", row.c.quantize ? "quantize" : "dequantize")
          .field_int("bits", row.c.bits)
          .field_string("dtype", row.c.dtype_name)
          .field_string("path", zerocore::simd_path_name(row.c.path))
          .field_int("bytes_per_call", row.c.bytes)
          .field_number("best_seconds", row.timing.best())
          .field_number("median_seconds", row.timing.median())
          .field_number("best_gbps", best)
          .field_number("median_gbps", gbps(row.c.bytes, row.timing.median()))
          .field_number("roofline_gbps", row.copy.best_gbps)
          .field_number("roofline_median_gbps", row.copy.median_gbps)
          .field_string("roofline_stores", row.copy.fastest.name())
          .field_number("fraction_of_roofline", best / row.copy.best_gbps)
          .field_string("shape", zerocore::stream_shape_name(row.c.shape))
          .field_number("shaped_roofline_gbps", row.shaped.best_gbps)
          .field_number("shaped_roofline_median_gbps", row.shaped.median_gbps)
          .field_string("shaped_roofline_stores", row.shaped.fastest.name())
          .field_number("fraction_of_shaped_roofline", best / row.shaped.best_gbps)
          .end_object();
    }
    out.end_array().end_object();
    std::printf("%s\n", out.str().c_str());
    return 0;
  }

  std::printf("quantize: %lld elements, group size %lld (%lld groups)\n", static_cast<long long>(elements),
              static_cast<long long>(group_size), static_cast<long long>(groups));
  std::printf("rooflines: the copy stream (8 B/element) and the stream of the call's shape (lines read:written),\n"
              "each its fastest variant ('stores': store kind, +pfNk a software prefetch N KiB ahead), their\n"
              "passes interleaved with the calls; %lld rounds after a warm-up round; GB/s = bytes read + written;\n"
              "'of copy' / 'of shape' = best / that roofline's best\n\n",
              static_cast<long long>(repeat));
  Table table({"threads", "direction", "bits", "dtype", "path", "MB/call", "best ms", "median ms", "best GB/s",
               "median GB/s", "copy GB/s", "of copy", "shape", "shape GB/s", "stores", "of shape"});
  for (const Row& row : rows) {
    const double best = gbps(row.c.bytes, row.timing.best());
    table.add_row({std::to_string(row.threads), row.c.quantize ? "quantize" : "dequantize",
                   std::to_string(row.c.bits), row.c.dtype_name, zerocore::simd_path_name(row.c.path),
                   format("%.1f", row.c.bytes * 1e-6), format("%.2f", row.timing.best() * 1e3),
                   format("%.2f", row.timing.median() * 1e3), format("%.2f", best),
                   format("%.2f", gbps(row.c.bytes, row.timing.median())), format("%.2f", row.copy.best_gbps),
                   format("%.3f", best / row.copy.best_gbps), zerocore::stream_shape_name(row.c.shape),
                   format("%.2f", row.shaped.best_gbps), row.shaped.fastest.name(),
                   format("%.3f", best / row.shaped.best_gbps)});
  }
  table.print(stdout);
  return 0;
}

}  // namespace zerocore_bench
