#include "zerocore/ready_tracker.hpp"

#include <algorithm>
#include <utility>

#include "zerocore/error.hpp"

namespace zerocore {

ReadyTracker::ReadyTracker(std::vector<int64_t> param_bucket, int64_t num_buckets, std::vector<int64_t> launch_order)
    : param_bucket_(std::move(param_bucket)),
      launch_order_(std::move(launch_order)),
      expected_(num_buckets, 0),
      marked_(param_bucket_.size(), 0) {
  ZC_CHECK_ARG(num_buckets >= 0, "num_buckets must be >= 0, got ", num_buckets);
  for (size_t i = 0; i < param_bucket_.size(); ++i) {
    const int64_t bucket = param_bucket_[i];
    ZC_CHECK_ARG(bucket >= 0 && bucket < num_buckets, "param_bucket[", i, "] must be in [0, ", num_buckets,
                 "), got ", bucket);
    ++expected_[bucket];
  }
  ZC_CHECK_ARG(static_cast<int64_t>(launch_order_.size()) == num_buckets, "launch_order must list all ",
               num_buckets, " buckets once, got ", launch_order_.size(), " entries");
  std::vector<uint8_t> seen(num_buckets, 0);
  for (int64_t bucket : launch_order_) {
    ZC_CHECK_ARG(bucket >= 0 && bucket < num_buckets && !seen[bucket],
                 "launch_order must be a permutation of the bucket indices; bad or repeated entry ", bucket);
    seen[bucket] = 1;
  }
  pending_ = expected_;
}

void ReadyTracker::reset() {
  pending_ = expected_;
  std::fill(marked_.begin(), marked_.end(), 0);
  cursor_ = 0;
  state_ = State::kIdle;
}

void ReadyTracker::mark_ready(int64_t param, std::vector<int64_t>& launch) {
  ZC_CHECK_ARG(param >= 0 && param < num_params(), "parameter index must be in [0, ", num_params(), "), got ",
               param);
  ZC_CHECK(state_ != State::kFinalized, "parameter ", param,
           " was marked ready after the backward pass was finalized; call reset() before the next backward");
  ZC_CHECK(!marked_[param], "parameter ", param,
           " was marked ready twice in one backward pass. This happens when a parameter's gradient is "
           "accumulated by two separate backward calls without a step in between, or when the model is run "
           "through two autograd graphs in one iteration");
  state_ = State::kInBackward;
  marked_[param] = 1;
  --pending_[param_bucket_[param]];
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
  state_ = State::kFinalized;
}

}  // namespace zerocore
