// table.cpp — aligned text tables and the human units they print.
#include "table.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"

namespace mem::tools {

Table::Table(std::vector<Column> columns) : columns_(std::move(columns)) {}

void Table::add_row(std::vector<std::string> cells) {
  if (cells.size() > columns_.size()) {
    throw Error(fmt::format("Table::add_row: {} cells for {} columns", cells.size(),
                            columns_.size()));
  }
  cells.resize(columns_.size());
  rows_.push_back(Row{false, std::move(cells)});
}

void Table::add_separator() { rows_.push_back(Row{true, {}}); }

std::string Table::render(std::string_view indent) const {
  std::vector<std::size_t> width(columns_.size());
  for (std::size_t c = 0; c < columns_.size(); ++c) width[c] = display_width(columns_[c].header);
  for (const Row& row : rows_) {
    for (std::size_t c = 0; c < row.cells.size(); ++c) {
      width[c] = std::max(width[c], display_width(row.cells[c]));
    }
  }
  std::size_t total = 0;
  for (std::size_t c = 0; c < width.size(); ++c) total += width[c] + (c == 0 ? 0 : 2);

  std::string out;
  const auto emit = [&](const std::vector<std::string>& cells, bool header) {
    std::string line(indent);
    for (std::size_t c = 0; c < columns_.size(); ++c) {
      if (c > 0) line += "  ";
      // Headers follow their column's alignment so units line up under them.
      line += pad(header ? columns_[c].header : cells[c], width[c], columns_[c].align);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  };
  std::vector<std::string> headers;
  for (const Column& col : columns_) headers.push_back(col.header);
  emit(headers, true);
  const std::string rule = std::string(indent) + std::string(total, '-') + '\n';
  out += rule;
  for (const Row& row : rows_) {
    if (row.separator) {
      out += rule;
    } else {
      emit(row.cells, false);
    }
  }
  return out;
}

std::size_t display_width(std::string_view text) noexcept {
  std::size_t n = 0;
  for (const char ch : text) {
    // Count every byte that does not continue a UTF-8 sequence.
    if ((static_cast<unsigned char>(ch) & 0xC0) != 0x80) ++n;
  }
  return n;
}

std::string pad(std::string_view text, std::size_t width, Align align) {
  const std::size_t w = display_width(text);
  if (w >= width) return std::string(text);
  const std::string fill(width - w, ' ');
  return align == Align::Left ? std::string(text) + fill : fill + std::string(text);
}

std::string human_bytes(std::int64_t bytes) {
  if (bytes >= 0) return format_bytes(static_cast<std::size_t>(bytes));
  // fmt rather than "-" + string: GCC 12 warns falsely (-Wrestrict) on the latter.
  return fmt::format("-{}", format_bytes(static_cast<std::size_t>(-bytes)));
}

std::string human_saving(std::int64_t saved, double fraction) {
  if (saved == 0) return "0 B";
  const double percent = 100.0 * fraction;
  // A few MiB of many GiB round to "0%", and "-0%" beside a loss reads as nothing at all.
  if (std::abs(percent) < 0.5) return fmt::format("{} ({}<1%)", human_bytes(saved), saved < 0 ? "-" : "");
  return fmt::format("{} ({:.0f}%)", human_bytes(saved), percent);
}

std::string human_share(double share) {
  if (share == 0.0) return "0";
  // Below 0.1% two significant digits (a selective plan's pointwise recompute is not nothing).
  if (share < 0.001) return fmt::format("{:.2g}%", 100.0 * share);
  return fmt::format("{:.1f}%", 100.0 * share);
}

std::string human_ms(double ms) {
  if (ms >= 1000.0) return fmt::format("{:.2f} s", ms / 1000.0);
  if (ms >= 100.0) return fmt::format("{:.0f} ms", ms);
  return fmt::format("{:.1f} ms", ms);
}

std::string human_count(std::int64_t n) {
  const std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? fmt::format("-{}", out) : out;
}

}  // namespace mem::tools
