// expression.cpp — a recursive-descent evaluator, checked for overflow at every step.
#include "expression.hpp"

#include <cctype>
#include <stdexcept>

namespace mem::models::detail {
namespace {

constexpr std::size_t kMaxLength = 256;  // a size formula, not a program
constexpr int kMaxNesting = 16;

class Parser {
 public:
  Parser(std::string_view text, const NameLookup& lookup) : text_(text), lookup_(lookup) {}

  std::int64_t run() {
    const std::int64_t v = sum();
    skip_space();
    if (pos_ != text_.size()) fail("unexpected '" + std::string(1, text_[pos_]) + "'");
    return v;
  }

 private:
  std::int64_t sum() {
    std::int64_t v = product();
    for (;;) {
      skip_space();
      if (eat('+')) {
        if (__builtin_add_overflow(v, product(), &v)) fail("overflows 64 bits");
      } else if (eat('-')) {
        if (__builtin_sub_overflow(v, product(), &v)) fail("overflows 64 bits");
      } else {
        return v;
      }
    }
  }

  std::int64_t product() {
    std::int64_t v = factor();
    for (;;) {
      skip_space();
      if (eat('*')) {
        if (__builtin_mul_overflow(v, factor(), &v)) fail("overflows 64 bits");
      } else if (eat('/')) {
        const std::int64_t d = factor();
        if (d == 0) fail("divides by zero");
        if (v % d != 0) fail(std::to_string(v) + " / " + std::to_string(d) + " is not a whole number");
        v /= d;
      } else {
        return v;
      }
    }
  }

  std::int64_t factor() {
    skip_space();
    if (pos_ == text_.size()) fail("ends where a number or name was expected");
    const char c = text_[pos_];
    if (c == '(') {
      if (++depth_ > kMaxNesting) fail("nests parentheses deeper than 16");
      ++pos_;
      const std::int64_t v = sum();
      skip_space();
      if (!eat(')')) fail("misses a ')'");
      --depth_;
      return v;
    }
    if (c == '-') {
      ++pos_;
      const std::int64_t v = factor();
      if (v == INT64_MIN) fail("overflows 64 bits");
      return -v;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      std::int64_t v = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, text_[pos_] - '0', &v)) {
          fail("overflows 64 bits");
        }
        ++pos_;
      }
      return v;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      const std::size_t start = pos_;
      while (pos_ < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) {
        ++pos_;
      }
      const std::string_view name = text_.substr(start, pos_ - start);
      const std::optional<std::int64_t> v = lookup_(name);
      if (!v) fail("names '" + std::string(name) + "', which is not one of the model's size options");
      return *v;
    }
    fail("unexpected '" + std::string(1, c) + "'");
  }

  void skip_space() {
    while (pos_ < text_.size() && text_[pos_] == ' ') ++pos_;
  }
  bool eat(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  [[noreturn]] void fail(const std::string& what) const { throw std::invalid_argument(what); }

  std::string_view text_;
  const NameLookup& lookup_;
  std::size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

std::int64_t evaluate(std::string_view text, const NameLookup& lookup) {
  if (text.size() > kMaxLength) throw std::invalid_argument("is longer than 256 characters");
  return Parser(text, lookup).run();
}

}  // namespace mem::models::detail
