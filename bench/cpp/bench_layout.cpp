// zerocore-bench layout: FlatLayout build time and rank_pieces query time for a model of N tensors
// (about a trillion parameters at the defaults).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "bench_common.hpp"
#include "zerocore/layout.hpp"

namespace zerocore_bench {
namespace {

// A model's tensors are mostly large weight matrices plus many small norm weights and biases, and some
// parameters with no elements (a frozen or pruned slot). The fractions are rough, not any real model's.
constexpr double kEmptyFraction = 0.02;
constexpr double kTinyFraction = 0.08;
constexpr int64_t kTinyMax = 4096;         // tiny tensors: 1..kTinyMax elements
constexpr double kLargeLogSigma = 1.0;     // large tensors: log-normal, spanning ~e^(+-2) around the median
constexpr double kLargeClipOfMean = 64.0;  // no single tensor above this many times the mean

// splitmix64: tiny and fully specified, so a seed gives the same sizes with every standard library
// (std::*_distribution are implementation-defined).
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1): never 0, so log() below is safe.
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() {  // Box-Muller; one of the pair is enough here
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
  }

 private:
  uint64_t state_;
};

// Sizes whose expected mean is mean_size: empty and tiny tensors at fixed fractions, the rest log-normal
// with its mean raised to make up for the small ones.
std::vector<int64_t> random_sizes(int64_t count, int64_t mean_size, uint64_t seed) {
  const double tiny_mean = (1.0 + kTinyMax) / 2.0;
  const double large_fraction = 1.0 - kEmptyFraction - kTinyFraction;
  const double large_mean = std::max(1.0, (mean_size - kTinyFraction * tiny_mean) / large_fraction);
  // A log-normal's mean is exp(mu + sigma^2 / 2).
  const double mu = std::log(large_mean) - 0.5 * kLargeLogSigma * kLargeLogSigma;
  const double clip = std::max(1.0, kLargeClipOfMean * static_cast<double>(mean_size));

  SplitMix64 rng(seed);
  std::vector<int64_t> sizes(count);
  for (int64_t& size : sizes) {
    const double kind = rng.uniform();
    if (kind < kEmptyFraction) {
      size = 0;
    } else if (kind < kEmptyFraction + kTinyFraction) {
      size = 1 + static_cast<int64_t>(rng.next() % kTinyMax);
    } else {
      size = static_cast<int64_t>(std::min(clip, std::max(1.0, std::exp(mu + kLargeLogSigma * rng.normal()))));
    }
  }
  return sizes;
}

struct RankQuery {
  int64_t rank;
  int64_t pieces;
  int64_t elements;  // sum of piece lengths: the rank's non-padding share
  Timing timing;
};

}  // namespace

int layout_command(int argc, char** argv) {
  int64_t tensors = 1000000;
  int64_t ranks = 4096;
  int64_t alignment = 64;
  int64_t bucket_cap = 500000000;
  int64_t mean_size = 1000000;
  int64_t seed = 1;
  int64_t repeat = 5;
  bool json = false;
  ArgParser parser("layout",
                   "Builds a FlatLayout of --tensors random sizes (about --mean-size elements each; 2% empty,\n"
                   "8% tiny) and times the build and rank_pieces() for the first, middle and last rank.");
  parser.add_int("tensors", &tensors, 0, "number of tensors");
  parser.add_int("ranks", &ranks, 1, "data-parallel world size");
  parser.add_int("alignment", &alignment, 1, "tensor and shard alignment in elements");
  parser.add_int("bucket-cap", &bucket_cap, 1, "bucket capacity in elements");
  parser.add_int("mean-size", &mean_size, 1, "mean elements per tensor");
  parser.add_int("seed", &seed, 0, "random seed for the sizes");
  parser.add_int("repeat", &repeat, 1, "timed repeats (the median is reported)");
  parser.add_flag("json", &json, "print one JSON object on stdout instead of the table");
  if (!parser.parse(argc, argv, 1)) return 0;

  const std::vector<int64_t> sizes = random_sizes(tensors, mean_size, static_cast<uint64_t>(seed));
  int64_t content = 0;
  int64_t empty = 0;
  for (int64_t size : sizes) {
    content += size;
    empty += size == 0;
  }

  // Each repeat builds from scratch; the previous layout is freed before the clock starts.
  std::unique_ptr<zerocore::FlatLayout> layout;
  Timing build;
  for (int64_t r = 0; r < repeat; ++r) {
    layout.reset();
    const auto start = std::chrono::steady_clock::now();
    layout = std::make_unique<zerocore::FlatLayout>(sizes, ranks, alignment, bucket_cap);
    build.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }

  std::vector<int64_t> query_ranks{0};
  if (ranks / 2 != 0) query_ranks.push_back(ranks / 2);
  if (ranks - 1 != ranks / 2 && ranks - 1 != 0) query_ranks.push_back(ranks - 1);
  std::vector<RankQuery> queries;
  for (int64_t rank : query_ranks) {
    std::vector<zerocore::Piece> pieces;
    RankQuery query{rank, 0, 0, time_repeats(repeat, [&] { pieces = layout->rank_pieces(rank); }, false)};
    query.pieces = static_cast<int64_t>(pieces.size());
    for (const zerocore::Piece& piece : pieces) query.elements += piece.length;
    queries.push_back(query);
  }

  if (json) {
    JsonWriter out;
    out.begin_object()
        .field_string("command", "layout")
        .field_int("tensors", tensors)
        .field_int("world_size", ranks)
        .field_int("alignment", alignment)
        .field_int("bucket_cap", bucket_cap)
        .field_int("mean_size", mean_size)
        .field_int("seed", seed)
        .field_int("repeat", repeat)
        .field_int("empty_tensors", empty)
        .field_int("total_elements", content)
        .field_int("padded_elements", layout->total_size())
        .field_int("buckets", layout->num_buckets())
        .field_int("shard_size", layout->shard_size())
        .field_number("build_median_seconds", build.median())
        .field_number("build_best_seconds", build.best())
        .begin_array("rank_pieces");
    for (const RankQuery& q : queries) {
      out.begin_object()
          .field_int("rank", q.rank)
          .field_int("pieces", q.pieces)
          .field_int("elements", q.elements)
          .field_number("median_seconds", q.timing.median())
          .field_number("best_seconds", q.timing.best())
          .end_object();
    }
    out.end_array().end_object();
    std::printf("%s\n", out.str().c_str());
    return 0;
  }

  const double padding = layout->total_size() > 0 ? 1.0 - static_cast<double>(content) / layout->total_size() : 0.0;
  std::printf("layout: %lld tensors (%lld empty), world %lld, alignment %lld, bucket cap %lld, seed %lld\n",
              static_cast<long long>(tensors), static_cast<long long>(empty), static_cast<long long>(ranks),
              static_cast<long long>(alignment), static_cast<long long>(bucket_cap), static_cast<long long>(seed));
  std::printf("  elements     %lld (%.3g), padded %lld (%.4f%% padding)\n", static_cast<long long>(content),
              static_cast<double>(content), static_cast<long long>(layout->total_size()), 100.0 * padding);
  std::printf("  buckets      %lld\n", static_cast<long long>(layout->num_buckets()));
  std::printf("  shard size   %lld elements per rank\n", static_cast<long long>(layout->shard_size()));
  std::printf("  build        %.3f ms median, %.3f ms best of %lld\n", build.median() * 1e3, build.best() * 1e3,
              static_cast<long long>(repeat));
  std::printf("  rank_pieces:\n");
  Table table({"rank", "pieces", "elements", "median ms", "best ms"});
  for (const RankQuery& q : queries) {
    table.add_row({std::to_string(q.rank), std::to_string(q.pieces), std::to_string(q.elements),
                   format("%.3f", q.timing.median() * 1e3), format("%.3f", q.timing.best() * 1e3)});
  }
  table.print(stdout, "    ");
  return 0;
}

}  // namespace zerocore_bench
