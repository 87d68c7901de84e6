#include "zerocore/prefetch_plan.hpp"

#include "zerocore/error.hpp"

#include <utility>

namespace zerocore {
namespace {

void check_units(const std::vector<int64_t>& recorded_order, const std::vector<int64_t>& unit_numel) {
  const size_t n = unit_numel.size();
  for (size_t u = 0; u < n; ++u) {
    ZC_CHECK_ARG(unit_numel[u] >= 0, "unit_numel[", u, "] must be >= 0, got ", unit_numel[u]);
  }
  for (size_t i = 0; i < recorded_order.size(); ++i) {
    ZC_CHECK_ARG(recorded_order[i] >= 0 && recorded_order[i] < static_cast<int64_t>(n), "recorded_order[", i,
                 "] must be a unit index in [0, ", n, "), got ", recorded_order[i]);
  }
}

// The functions' states (the planner reads the caller's bytes as given: nonzero is sharded).
void check_sharded(const std::vector<uint8_t>& unit_sharded, size_t n) {
  ZC_CHECK_ARG(unit_sharded.size() == n, "unit_sharded must have one entry per unit (", n, "), got ",
               unit_sharded.size());
  for (size_t u = 0; u < n; ++u) {
    ZC_CHECK_ARG(unit_sharded[u] <= 1, "unit_sharded[", u, "] must be 0 or 1, got ", int(unit_sharded[u]));
  }
}

void check_live(int64_t live_elements, int64_t max_live) {
  ZC_CHECK_ARG(live_elements >= 0, "live_elements must be >= 0, got ", live_elements);
  ZC_CHECK_ARG(max_live >= 0, "max_live must be >= 0, got ", max_live);
}

void check_persistent(const std::vector<uint8_t>& unit_persistent, size_t n) {
  ZC_CHECK_ARG(unit_persistent.size() == n, "unit_persistent must have one entry per unit (", n, "), got ",
               unit_persistent.size());
  for (size_t u = 0; u < n; ++u) {
    ZC_CHECK_ARG(unit_persistent[u] <= 1, "unit_persistent[", u, "] must be 0 or 1, got ",
                 int(unit_persistent[u]));
  }
}

// live + numel <= max_live without overflow (all three are >= 0).
bool fits(int64_t live, int64_t numel, int64_t max_live) { return live <= max_live && numel <= max_live - live; }

}  // namespace

std::vector<int64_t> plan_forward_prefetch(const std::vector<int64_t>& recorded_order, int64_t position,
                                           const std::vector<int64_t>& unit_numel,
                                           const std::vector<uint8_t>& unit_sharded,
                                           const std::vector<uint8_t>& unit_persistent, int64_t live_elements,
                                           int64_t max_live, int64_t prefetch_budget) {
  check_sharded(unit_sharded, unit_numel.size());
  return PrefetchPlanner(recorded_order, unit_numel, unit_persistent)
      .forward(position, unit_sharded.data(), live_elements, max_live, prefetch_budget);
}

std::optional<int64_t> plan_backward_prefetch(const std::vector<int64_t>& recorded_order, int64_t unit,
                                              int64_t visit, const std::vector<int64_t>& unit_numel,
                                              const std::vector<uint8_t>& unit_sharded,
                                              const std::vector<uint8_t>& unit_persistent, int64_t live_elements,
                                              int64_t max_live) {
  check_sharded(unit_sharded, unit_numel.size());
  return PrefetchPlanner(recorded_order, unit_numel, unit_persistent)
      .backward(unit, visit, unit_sharded.data(), live_elements, max_live);
}

PrefetchPlanner::PrefetchPlanner(std::vector<int64_t> recorded_order, std::vector<int64_t> unit_numel,
                                 std::vector<uint8_t> unit_persistent)
    : order_(std::move(recorded_order)), numel_(std::move(unit_numel)), persistent_(std::move(unit_persistent)) {
  check_units(order_, numel_);
  check_persistent(persistent_, numel_.size());
  occurrences_.resize(numel_.size());
  for (size_t i = 0; i < order_.size(); ++i) occurrences_[static_cast<size_t>(order_[i])].push_back(i);
  counted_at_.assign(numel_.size(), 0);
}

std::vector<int64_t> PrefetchPlanner::forward(int64_t position, const uint8_t* unit_sharded, int64_t live_elements,
                                              int64_t max_live, int64_t prefetch_budget) const {
  ZC_CHECK_ARG(position >= 0 && position <= static_cast<int64_t>(order_.size()), "position must be in [0, ",
               order_.size(), "], got ", position);
  check_live(live_elements, max_live);
  ZC_CHECK_ARG(prefetch_budget >= 0, "prefetch_budget must be >= 0, got ", prefetch_budget);
  const uint64_t walk = ++walk_;
  std::vector<int64_t> started;
  int64_t live = live_elements;
  int64_t budget = prefetch_budget;
  for (size_t i = static_cast<size_t>(position); i < order_.size() && budget > 0; ++i) {
    const auto unit = static_cast<size_t>(order_[i]);
    if (counted_at_[unit] == walk) continue;
    const int64_t numel = numel_[unit];
    if (!unit_sharded[unit]) {
      if (persistent_[unit]) continue;
      counted_at_[unit] = walk;
      budget -= numel;  // already ahead: it holds the budget as if this walk had started it
      continue;
    }
    if (!fits(live, numel, max_live)) break;
    started.push_back(static_cast<int64_t>(unit));
    counted_at_[unit] = walk;
    live += numel;
    budget -= numel;  // may go negative: a unit larger than the budget left is still started
  }
  return started;
}

std::optional<int64_t> PrefetchPlanner::backward(int64_t unit, int64_t visit, const uint8_t* unit_sharded,
                                                 int64_t live_elements, int64_t max_live) const {
  ZC_CHECK_ARG(unit >= 0 && unit < static_cast<int64_t>(numel_.size()), "unit must be a unit index in [0, ",
               numel_.size(), "), got ", unit);
  ZC_CHECK_ARG(visit >= 0, "visit must be >= 0, got ", visit);
  check_live(live_elements, max_live);
  const auto& seen = occurrences_[static_cast<size_t>(unit)];
  if (static_cast<uint64_t>(visit) >= seen.size()) return std::nullopt;
  for (size_t i = seen[seen.size() - 1 - static_cast<size_t>(visit)]; i-- > 0;) {
    const auto previous = static_cast<size_t>(order_[i]);
    if (unit_sharded[previous] && !persistent_[previous]) {
      if (fits(live_elements, numel_[previous], max_live)) return static_cast<int64_t>(previous);
      return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace zerocore
