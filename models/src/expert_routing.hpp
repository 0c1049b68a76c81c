// expert_routing.hpp — how many tokens each expert of a mixture of experts gets, assumed.
//
// A recorded per-expert loop (transformers' "eager" experts: python/vramscope/export/_routing.py)
// sizes each expert's tensors by the rows routed to it, which are data: the model file names
// them expert_rows_<e> and says "routing": tokens x top_k assignments over the experts. Here
// they are spread evenly, or with the busiest expert (the last, the loop's worst place: every
// earlier expert's saved tensors are alive then) given expert_skew times its even share, at
// most every token (an expert sees a token once).
#pragma once

#include <cstdint>
#include <string>

namespace mem::models::detail {

struct ExpertRouting {
  std::int64_t experts = 0;
  std::int64_t top_k = 0;
  std::int64_t tokens = 0;  ///< at the run's batch and sequence
  std::int64_t skew = 1;    ///< the model option expert_skew
  std::string tokens_formula;  ///< the file's "tokens" ("batch*seq"), for the description

  /// The rows expert `e` (0-based, < experts) gets.
  std::int64_t rows(std::int64_t e) const;
  /// One line for the tables' assumptions.
  std::string describe() const;

 private:
  std::int64_t busiest() const;
};

}  // namespace mem::models::detail
