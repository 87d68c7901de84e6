// Decides when gradient buckets launch their reduction, independently of the order in which gradients
// become ready, so every rank issues the same collectives in the same order (a rank that issued them in
// another order would hang or, worse, mix buckets of equal size).
//
// Note [Bucket launch order]
// --------------------------
// Buckets launch strictly in `launch_order` (by default the reverse of the layout order, because
// backward produces the last parameters' gradients first). A bucket whose parameters are all ready waits
// until every bucket before it in launch_order has launched ("not its turn yet"), as in DDP's Reducer.
// At the end of backward, finalize() launches every bucket not yet launched, still in launch_order, and
// lists the parameters that were never marked so their slots can be zero-filled: unused parameters
// never leave a rank waiting in a collective that the other ranks skipped.
//
// The tracker also records the order in which this backward completed the buckets (the arrival of each one's
// last gradient; at finalize() the rest, in launch order), and takes a new launch order between backwards:
// an engine launches from its second backward on in the order its first one completed them on one rank (the
// same order on every rank), so a bucket holding a module that runs before the modules registered ahead of it
// no longer keeps the buckets after it waiting (Note [Reducer memory] in bindings/grad_reducer.hpp).
#pragma once

#include <cstdint>
#include <vector>

namespace zerocore {

class ReadyTracker {
 public:
  enum class State { kIdle, kInBackward, kFinalized };

  // param_bucket[i]: the bucket of parameter i. launch_order: a permutation of [0, num_buckets).
  // Throws InvalidArgument when a bucket index is out of range or launch_order is not a permutation; the
  // sizes are checked before anything of num_buckets entries is allocated.
  ReadyTracker(std::vector<int64_t> param_bucket, int64_t num_buckets, std::vector<int64_t> launch_order);

  int64_t num_params() const { return static_cast<int64_t>(param_bucket_.size()); }
  int64_t num_buckets() const { return static_cast<int64_t>(expected_.size()); }
  State state() const { return state_; }
  const std::vector<int64_t>& launch_order() const { return launch_order_; }

  // Starts a backward pass: every parameter unmarked, no bucket launched. Legal in any state.
  void reset();

  // Marks parameter `param` ready and appends to `launch` the buckets that may launch now, in order.
  // Throws std::runtime_error when the parameter was already marked in this backward, or after finalize().
  void mark_ready(int64_t param, std::vector<int64_t>& launch);

  // Throws what mark_ready(param, ...) would throw for a bad index or a second mark, changing nothing: a
  // caller that copies the gradient before marking checks first.
  void check_can_mark(int64_t param) const;

  // Ends the backward: appends the buckets still to launch (in order) to `launch`, and the parameters
  // never marked to `unmarked`. Throws std::runtime_error if called twice without reset().
  void finalize(std::vector<int64_t>& launch, std::vector<int64_t>& unmarked);

  // The buckets this backward completed, in the order it completed them; after finalize() every bucket.
  const std::vector<int64_t>& completion_order() const { return completion_order_; }

  // Launches in `launch_order` from the next backward on. Throws InvalidArgument unless it is a permutation
  // of the buckets, and std::runtime_error during a backward (between mark_ready() and finalize()).
  void set_launch_order(std::vector<int64_t> launch_order);

  bool is_marked(int64_t param) const { return marked_.at(param) != 0; }

 private:
  void advance(std::vector<int64_t>& launch);
  void complete(int64_t bucket);

  std::vector<int64_t> param_bucket_;  // bucket of each parameter
  std::vector<int64_t> launch_order_;  // the one order every rank launches buckets in
  std::vector<int64_t> expected_;      // parameters per bucket
  std::vector<int64_t> pending_;       // parameters per bucket not yet marked in this backward
  std::vector<uint8_t> marked_;        // per parameter: marked in this backward
  std::vector<uint8_t> completed_;     // per bucket: in completion_order_
  std::vector<int64_t> completion_order_;
  int64_t cursor_ = 0;                 // next position in launch_order_ to launch
  State state_ = State::kIdle;
};

}  // namespace zerocore
