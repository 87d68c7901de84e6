// Stage 3 prefetch decisions: which units to start gathering ahead of use, as pure functions of the
// recorded forward order and the units' sizes and states. The runtime (python/zerocore/_stage3.py) owns the
// state and the collectives; these functions only decide.
//
// Note [Stage 3 prefetch plan]
// ----------------------------
// Units are named by their index into `unit_numel` (0..n-1). `recorded_order` is the sequence of units
// gathered by the first whole forward; it may name a unit more than once (a block called twice).
// `unit_sharded[u]` is 1 while unit u is at rest (neither gathering nor gathered), `live_elements` the
// elements currently gathered, `max_live` the cap prefetching keeps them under (stage3_max_live_parameters).
//
// Forward, after unit recorded_order[position - 1] was gathered: walk recorded_order from `position`
// while the budget (stage3_prefetch_bucket_size) is above zero. The budget bounds what is gathered AHEAD
// of the computing unit, not what one call starts: a unit met in the walk that is not sharded (gathered or
// gathering already, started by an earlier call or by the optimizer step) spends its size of the budget as
// if this call had started it, unless it is persistent (`unit_persistent[u]`: it stays gathered through
// the step whatever the plan, so it is skipped for free). Each unit is counted once per walk (a repeated
// unit is started or counted at its first occurrence). The first sharded unit that would take the live
// elements above max_live ends the walk (a stop, not a skip, so gathers follow the recorded order).
// Otherwise the unit is started: live elements and the spent budget grow by its size. A unit larger than
// what is left of a positive budget is still started. So with a budget of one element the forward holds
// the computing unit and the next one, as FSDP2's default does; if starts alone were counted, every
// call would start a budget's worth beyond what earlier calls started, and the lookahead would grow by
// the units the step started (and, with a budget of k units, by k - 1 per unit, up to max_live).
//
// Backward, after `unit` was gathered for its backward: backward runs the recorded order in reverse, so
// its `visit`-th backward in this backward (0: the first) is its `visit`-th occurrence in recorded_order
// counted from the end; from just before that occurrence walk backwards to the first unit that is sharded
// and not persistent; prefetch it if live_elements + its size <= max_live, and stop there either way. Units
// that are not sharded, or persistent, are skipped. Nothing when `unit` occurs `visit` times or fewer (or
// not at all). The caller passes the states after gathering `unit` (so `unit` itself is not sharded). The
// occurrence matters for a unit called twice: walking from its last occurrence on its second backward would
// meet the units whose backward is over already, whose states the ranks need not share (a unit released
// when its last gradient arrived, on ranks whose batch reached all its parameters).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace zerocore {

// The units to start gathering now, in order; see Note [Stage 3 prefetch plan].
// Throws InvalidArgument (naming the argument) when unit_sharded's or unit_persistent's size differs from
// unit_numel's, an entry of recorded_order is not a unit index, position is outside
// [0, recorded_order.size()], a flag is not 0 or 1, or a size, live_elements, max_live or prefetch_budget
// is negative.
std::vector<int64_t> plan_forward_prefetch(const std::vector<int64_t>& recorded_order, int64_t position,
                                           const std::vector<int64_t>& unit_numel,
                                           const std::vector<uint8_t>& unit_sharded,
                                           const std::vector<uint8_t>& unit_persistent, int64_t live_elements,
                                           int64_t max_live, int64_t prefetch_budget);

// The unit to start gathering before `unit`'s backward, or nothing; see Note [Stage 3 prefetch plan].
// Throws InvalidArgument (naming the argument) on the same bad inputs as plan_forward_prefetch, and when
// `unit` is not a unit index or `visit` is negative.
std::optional<int64_t> plan_backward_prefetch(const std::vector<int64_t>& recorded_order, int64_t unit,
                                              int64_t visit, const std::vector<int64_t>& unit_numel,
                                              const std::vector<uint8_t>& unit_sharded,
                                              const std::vector<uint8_t>& unit_persistent, int64_t live_elements,
                                              int64_t max_live);

// The same decisions for one recorded order, asked once per unit visit (the functions above are one question
// to a planner built for it): the order, the sizes and the persistence are taken and checked once, each
// unit's occurrences indexed, and the units' states read in place from the caller's array, so a question
// costs the walk it makes, not a pass over the units (asking the functions from Python at every visit made a
// step quadratic in the units: 56 ms for a forward's questions at 1000 units, 1 ms with a planner).
class PrefetchPlanner {
 public:
  // Throws InvalidArgument on the inputs plan_forward_prefetch refuses.
  PrefetchPlanner(std::vector<int64_t> recorded_order, std::vector<int64_t> unit_numel,
                  std::vector<uint8_t> unit_persistent);

  size_t num_units() const { return numel_.size(); }

  // `unit_sharded`: num_units() entries, nonzero for a sharded unit. Throws InvalidArgument on a bad
  // position, a negative live_elements, max_live or prefetch_budget.
  std::vector<int64_t> forward(int64_t position, const uint8_t* unit_sharded, int64_t live_elements,
                               int64_t max_live, int64_t prefetch_budget) const;
  std::optional<int64_t> backward(int64_t unit, int64_t visit, const uint8_t* unit_sharded, int64_t live_elements,
                                  int64_t max_live) const;

 private:
  std::vector<int64_t> order_;
  std::vector<int64_t> numel_;
  std::vector<uint8_t> persistent_;
  std::vector<std::vector<size_t>> occurrences_;  // per unit, its positions in order_, ascending
  mutable std::vector<uint64_t> counted_at_;       // the walk that counted each unit (forward's "counted")
  mutable uint64_t walk_ = 0;
};

}  // namespace zerocore
