// zerocore-bench stream: memory bandwidth of copy, triad and the Adam-shaped stream per thread count, with
// regular and non-temporal stores. See Note [Stream probe accounting] in zerocore/stream_probe.hpp.
#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "zerocore/simd.hpp"
#include "zerocore/stream_probe.hpp"
#include "zerocore/thread_pool.hpp"

namespace zerocore_bench {
namespace {

std::vector<zerocore::StoreKind> store_kinds(const std::string& choice, zerocore::SimdPath path) {
  using zerocore::StoreKind;
  if (choice == "regular") return {StoreKind::kRegular};
  if (!zerocore::stream_supports_non_temporal(path)) {
    if (choice == "nt") {
      throw UsageError(std::string("non-temporal stores are not available on the '") +
                       zerocore::simd_path_name(path) + "' stream path");
    }
    return {StoreKind::kRegular};
  }
  if (choice == "nt") return {StoreKind::kNonTemporal};
  return {StoreKind::kRegular, StoreKind::kNonTemporal};
}

// Index of the fastest result among results[first..] of one (threads, kernel): the roofline row.
size_t fastest_index(const std::vector<zerocore::StreamResult>& results, size_t first) {
  size_t best = first;
  for (size_t i = first; i < results.size(); ++i) {
    if (results[i].best_gbps() > results[best].best_gbps()) best = i;
  }
  return best;
}

}  // namespace

int stream_command(int argc, char** argv) {
  int64_t size_mb = 1024;
  int64_t elements = 0;
  std::vector<int64_t> threads{default_threads()};
  int64_t repeat = 10;
  std::vector<std::string> kernels{"copy", "triad", "adam"};
  std::string stores = "both";
  std::string path_name = "auto";
  bool json = false;
  ArgParser parser("stream",
                   "Memory bandwidth of fp32 streams: copy (a = b), triad (a = b + s*c) and adam (p, m, v updated\n"
                   "in place from p, g, m, v: Adam's 4 reads and 3 writes). GB/s = 1e9 bytes/s counting the\n"
                   "loop's reads plus writes (no read-for-ownership), best and median of --repeat passes.");
  parser.add_int("size-mb", &size_mb, 1, "MiB per array (2^20 bytes; adam uses 4 arrays, copy 2)");
  parser.add_int("elements", &elements, 1, "fp32 elements per array, instead of --size-mb", "from --size-mb");
  parser.add_int_list("threads", &threads, 1, "thread counts to measure, e.g. 1,2", kMaxThreads);
  parser.add_int("repeat", &repeat, 1, "timed passes per measurement, after one warm-up pass", "", kMaxRepeat);
  parser.add_choice_list("kernel", &kernels, {"copy", "triad", "adam"}, "kernels to run");
  parser.add_choice("stores", &stores, {"regular", "nt", "both"}, "store kind; nt = non-temporal");
  parser.add_choice("path", &path_name, {"auto", "scalar", "avx512"},
                    "code path; auto = the widest this CPU runs, scalar = the portable loops");
  parser.add_flag("json", &json, "print one JSON object on stdout instead of the table");
  if (!parser.parse(argc, argv, 1)) return 0;
  if (parser.was_set("elements") && parser.was_set("size-mb")) {
    throw UsageError("give --size-mb or --elements, not both");
  }
  if (size_mb > (int64_t{1} << 40)) throw UsageError("--size-mb is too large: " + std::to_string(size_mb));
  if (!parser.was_set("elements")) elements = size_mb * (int64_t{1} << 20) / static_cast<int64_t>(sizeof(float));

  const zerocore::SimdPath requested =
      path_name == "auto" ? zerocore::best_simd_path() : zerocore::parse_simd_path(path_name);
  const zerocore::SimdPath path = zerocore::stream_probe_path(requested);
  if (path != requested && path_name != "auto") {
    throw UsageError("--path " + path_name + " is not available in this build or on this CPU");
  }
  const std::vector<zerocore::StoreKind> store_list = store_kinds(stores, path);

  std::vector<zerocore::StreamResult> results;
  std::vector<size_t> roofline_rows;
  for (int64_t thread_count : threads) {
    zerocore::ThreadPool pool(static_cast<int>(thread_count));
    zerocore::StreamProbe probe(elements, &pool, path);  // per pool: first touch follows its partition
    for (const std::string& kernel_name : kernels) {
      const zerocore::StreamKernel kernel = zerocore::parse_stream_kernel(kernel_name);
      const size_t first = results.size();
      for (zerocore::StoreKind store : store_list) {
        results.push_back(probe.run(kernel, store, static_cast<int>(repeat)));
      }
      roofline_rows.push_back(fastest_index(results, first));
    }
  }

  if (json) {
    JsonWriter out;
    out.begin_object()
        .field_string("command", "stream")
        .field_int("elements", elements)
        .field_int("bytes_per_array", elements * static_cast<int64_t>(sizeof(float)))
        .field_string("path", zerocore::simd_path_name(path))
        .field_int("repeat", repeat)
        .field_int("hardware_threads", default_threads())
        .begin_array("results");
    for (const zerocore::StreamResult& r : results) {
      out.begin_object()
          .field_int("threads", r.threads)
          .field_string("kernel", zerocore::stream_kernel_name(r.kernel))
          .field_string("stores", zerocore::store_kind_name(r.stores))
          .field_int("bytes_per_element", zerocore::stream_kernel_bytes_per_element(r.kernel))
          .field_int("bytes_per_pass", r.bytes_per_pass)
          .field_number("best_seconds", r.best_seconds)
          .field_number("median_seconds", r.median_seconds)
          .field_number("best_gbps", r.best_gbps())
          .field_number("median_gbps", r.median_gbps())
          .end_object();
    }
    out.end_array().begin_array("roofline");
    for (size_t row : roofline_rows) {
      const zerocore::StreamResult& r = results[row];
      out.begin_object()
          .field_int("threads", r.threads)
          .field_string("kernel", zerocore::stream_kernel_name(r.kernel))
          .field_string("stores", zerocore::store_kind_name(r.stores))
          .field_number("best_gbps", r.best_gbps())
          .end_object();
    }
    out.end_array().end_object();
    std::printf("%s\n", out.str().c_str());
    return 0;
  }

  std::printf("stream: %lld fp32 elements per array (%.1f MiB), path %s, %lld passes after a warm-up\n",
              static_cast<long long>(elements), elements * 4.0 / (1 << 20), zerocore::simd_path_name(path),
              static_cast<long long>(repeat));
  std::printf("GB/s = 1e9 bytes/s of reads + writes; * = the faster store kind (the roofline)\n\n");
  Table table({"threads", "kernel", "stores", "B/elem", "best GB/s", "median GB/s", "best ms", "median ms", ""});
  for (size_t i = 0; i < results.size(); ++i) {
    const zerocore::StreamResult& r = results[i];
    bool is_roofline = false;
    for (size_t row : roofline_rows) is_roofline = is_roofline || row == i;
    table.add_row({std::to_string(r.threads), zerocore::stream_kernel_name(r.kernel),
                   zerocore::store_kind_name(r.stores),
                   std::to_string(zerocore::stream_kernel_bytes_per_element(r.kernel)),
                   format("%.2f", r.best_gbps()), format("%.2f", r.median_gbps()),
                   format("%.2f", r.best_seconds * 1e3), format("%.2f", r.median_seconds * 1e3),
                   is_roofline && store_list.size() > 1 ? "*" : ""});
  }
  table.print(stdout);
  return 0;
}

}  // namespace zerocore_bench
