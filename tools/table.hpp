// table.hpp — aligned text tables with human units, for every table the
// command prints (sweep rows, devices, models).
//
//   mem::tools::Table t{{{"config", Align::Left}, {"max alloc", Align::Right}}};
//   t.add_row({"f32 seg 16", mem::format_bytes(peak)});
//   std::cout << t.render();
//
// Widths count characters, not bytes, so UTF-8 cells ("≈", "—") stay aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mem::tools {

enum class Align { Left, Right };

struct Column {
  std::string header;
  Align align = Align::Right;
};

class Table {
 public:
  explicit Table(std::vector<Column> columns);

  /// Appends a row; missing cells are blank, extra cells are an error (mem::Error).
  void add_row(std::vector<std::string> cells);
  /// A line of dashes under the previous row (groups of rows).
  void add_separator();

  std::size_t rows() const noexcept { return rows_.size(); }
  const std::vector<Column>& columns() const noexcept { return columns_; }

  /// Header, a dashed rule, then the rows; columns separated by two spaces,
  /// trailing blanks trimmed, each line prefixed with `indent`.
  std::string render(std::string_view indent = "") const;

 private:
  struct Row {
    bool separator = false;
    std::vector<std::string> cells;
  };
  std::vector<Column> columns_;
  std::vector<Row> rows_;
};

/// Characters on screen of a UTF-8 string (code points; no wide glyphs are used).
std::size_t display_width(std::string_view text) noexcept;
/// `text` padded with spaces to `width` characters on the side `align` leaves open.
std::string pad(std::string_view text, std::size_t width, Align align);

// --- human units -------------------------------------------------------------
/// Bytes as "7.79 GiB" / "392.00 MiB" / "512 B" (PyTorch's format); negative as "-1.00 GiB".
std::string human_bytes(std::int64_t bytes);
/// A saving: "4.12 GiB (61%)"; "—" for none.
std::string human_saving(std::int64_t saved, double fraction);
/// A share as a percentage: "12.5%"; "0" for none.
std::string human_share(double share);
/// Milliseconds: "12.3 ms", "1.42 s".
std::string human_ms(double ms);
/// A count with thousands separators: "11,689,512".
std::string human_count(std::int64_t n);

}  // namespace mem::tools
