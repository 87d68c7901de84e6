#include "zerocore/ready_tracker.hpp"

#include <algorithm>
#include <utility>

#include "zerocore/error.hpp"

namespace zerocore {

namespace {

// Checks the constructor's arguments before any per-bucket allocation: a huge or negative num_buckets must be
// a ValueError naming it, not a std::length_error or a many-terabyte allocation.
std::vector<int64_t> validated_param_bucket(std::vector<int64_t> param_bucket, int64_t num_buckets,
                                            const std::vector<int64_t>& launch_order) {
  ZC_CHECK_ARG(num_buckets >= 0, "num_buckets must be >= 0, got ", num_buckets);
  ZC_CHECK_ARG(static_cast<int64_t>(launch_order.size()) == num_buckets, "launch_order must list all ",
               num_buckets, " buckets once, got ", launch_order.size(), " entries");
  for (size_t i = 0; i < param_bucket.size(); ++i) {
    ZC_CHECK_ARG(param_bucket[i] >= 0 && param_bucket[i] < num_buckets, "param_bucket[", i, "] must be in [0, ",
                 num_buckets, "), got ", param_bucket[i]);
  }
  return param_bucket;
}

// Checked before anything of its size is allocated: launch_order.size() == num_buckets.
void check_permutation(const std::vector<int64_t>& launch_order, int64_t num_buckets) {
  ZC_CHECK_ARG(static_cast<int64_t>(launch_order.size()) == num_buckets, "launch_order must list all ",
               num_buckets, " buckets once, got ", launch_order.size(), " entries");
  std::vector<uint8_t> seen(num_buckets, 0);
  for (int64_t bucket : launch_order) {
    ZC_CHECK_ARG(bucket >= 0 && bucket < num_buckets && !seen[bucket],
                 "launch_order must be a permutation of the bucket indices; bad or repeated entry ", bucket);
    seen[bucket] = 1;
  }
}

}  // namespace

ReadyTracker::ReadyTracker(std::vector<int64_t> param_bucket, int64_t num_buckets, std::vector<int64_t> launch_order)
    : param_bucket_(validated_param_bucket(std::move(param_bucket), num_buckets, launch_order)),
      launch_order_(std::move(launch_order)) {
  check_permutation(launch_order_, num_buckets);
  expected_.assign(num_buckets, 0);
  for (int64_t bucket : param_bucket_) ++expected_[bucket];
  marked_.assign(param_bucket_.size(), 0);
  completed_.assign(num_buckets, 0);
  pending_ = expected_;
}

void ReadyTracker::reset() {
  pending_ = expected_;
  std::fill(marked_.begin(), marked_.end(), 0);
  std::fill(completed_.begin(), completed_.end(), 0);
  completion_order_.clear();
  cursor_ = 0;
  state_ = State::kIdle;
}

void ReadyTracker::set_launch_order(std::vector<int64_t> launch_order) {
  check_permutation(launch_order, num_buckets());
  ZC_CHECK(state_ != State::kInBackward, "set_launch_order() during a backward pass; call it after finalize()");
  launch_order_ = std::move(launch_order);  // (reset() starts the next backward at its first bucket)
}

void ReadyTracker::complete(int64_t bucket) {
  if (!completed_[bucket]) {
    completed_[bucket] = 1;
    completion_order_.push_back(bucket);
  }
}

void ReadyTracker::check_can_mark(int64_t param) const {
  ZC_CHECK_ARG(param >= 0 && param < num_params(), "parameter index must be in [0, ", num_params(), "), got ",
               param);
  ZC_CHECK(state_ != State::kFinalized, "parameter ", param,
           " was marked ready after the backward pass was finalized; call reset() before the next backward");
  ZC_CHECK(!marked_[param], "parameter ", param,
           " was marked ready twice in one backward pass. This happens when a parameter's gradient is "
           "accumulated by two separate backward calls without a step in between, or when the model is run "
           "through two autograd graphs in one iteration");
}

void ReadyTracker::mark_ready(int64_t param, std::vector<int64_t>& launch) {
  check_can_mark(param);
  state_ = State::kInBackward;
  marked_[param] = 1;
  if (--pending_[param_bucket_[param]] == 0) complete(param_bucket_[param]);
  advance(launch);
}

void ReadyTracker::advance(std::vector<int64_t>& launch) {
  while (cursor_ < num_buckets() && pending_[launch_order_[cursor_]] == 0) {
    launch.push_back(launch_order_[cursor_]);
    ++cursor_;
  }
}

void ReadyTracker::finalize(std::vector<int64_t>& launch, std::vector<int64_t>& unmarked) {
  ZC_CHECK(state_ != State::kFinalized, "finalize() was called twice for one backward pass");
  for (int64_t i = 0; i < num_params(); ++i) {
    if (!marked_[i]) unmarked.push_back(i);
  }
  while (cursor_ < num_buckets()) launch.push_back(launch_order_[cursor_++]);
  for (int64_t bucket : launch_order_) complete(bucket);  // (zero-filled now, or without parameters)
  state_ = State::kFinalized;
}

}  // namespace zerocore
