// expert_routing.cpp — the assumed rows per expert.
#include "expert_routing.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace mem::models::detail {

std::int64_t ExpertRouting::busiest() const {
  // Assignments are tokens x top_k (top_k <= experts, so an even share never exceeds tokens);
  // ceil(total x skew / experts) without overflow: q x skew + ceil(r x skew / experts).
  const std::int64_t total = tokens * top_k;
  const std::int64_t q = total / experts;
  const std::int64_t r = total % experts;
  const std::int64_t even = q + (r != 0 ? 1 : 0);
  if (q >= (tokens + skew - 1) / skew) return tokens;  // q x skew reaches every token
  const std::int64_t skewed = q * skew + (r * skew + experts - 1) / experts;
  return std::min(tokens, std::max(even, skewed));
}

std::int64_t ExpertRouting::rows(std::int64_t e) const {
  if (experts == 1) return tokens * top_k;
  const std::int64_t last = busiest();
  if (e == experts - 1) return last;
  const std::int64_t rest = tokens * top_k - last;
  const std::int64_t share = rest / (experts - 1);
  return share + (e < rest % (experts - 1) ? 1 : 0);
}

std::string ExpertRouting::describe() const {
  const auto span = [](std::int64_t low, std::int64_t high) {
    return low == high ? std::to_string(low) : fmt::format("{} to {}", low, high);
  };
  // The tokens as the file's formula, and their number at the options described.
  const std::string head =
      tokens_formula.empty()
          ? fmt::format("routing: {} tokens x top-{} over {} experts", tokens, top_k, experts)
          : fmt::format("routing: {} tokens ({} here) x top-{} over {} experts", tokens_formula, tokens, top_k, experts);
  if (experts == 1) return head + fmt::format(": {} rows", rows(0));
  const std::int64_t fewest = rows(experts - 2), most = rows(0);
  if (skew == 1) {
    return head + fmt::format(", spread evenly (assumed; --model-options expert_skew=S gives the busiest expert S times "
                              "its share): {} rows each",
                              span(std::min(fewest, rows(experts - 1)), std::max(most, rows(experts - 1))));
  }
  return head + fmt::format(", skewed (assumed, expert_skew={}): the busiest expert gets {} rows ({} times its even "
                            "share, at most every token), the others {}",
                            skew, rows(experts - 1), skew, span(fewest, most));
}

}  // namespace mem::models::detail
