// sweep_plot.cpp — the sweep's memory-vs-segments SVG, written by hand (a few
// polylines and labels do not need a plotting library).
#include "sweep_plot.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "sweep_report.hpp"
#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/exports.hpp"  // xml_escape

namespace mem::tools {

namespace {

constexpr std::array<const char*, 6> kColours = {"#1f77b4", "#ff7f0e", "#2ca02c",
                                                 "#9467bd", "#8c564b", "#17becf"};

struct Axis {
  double unit;        ///< bytes per label unit
  const char* name;   ///< "GiB" / "MiB"
  double step;        ///< in label units
  double top;         ///< in bytes
};

Axis y_axis(double max_bytes) {
  const bool gib = max_bytes >= 2.0 * static_cast<double>(GiB);
  Axis a{gib ? static_cast<double>(GiB) : static_cast<double>(MiB), gib ? "GiB" : "MiB", 1, 0};
  const double span = std::max(max_bytes / a.unit, 1e-9);
  const double raw = span / 6.0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    a.step = m * mag;
    if (a.step >= raw) break;
  }
  a.top = std::ceil(span / a.step) * a.step * a.unit;
  return a;
}

std::string label_number(double v) {
  if (std::abs(v - std::round(v)) < 1e-9) return fmt::format("{:.0f}", v);
  return fmt::format("{:.1f}", v);
}

}  // namespace

std::string sweep_plot_svg(const planner::SweepResult& result, int width, int height) {
  // Segment counts on an even categorical axis: 0, 2, 4, 8, 16, 23, 32 are far from
  // linear and a log axis has no place for 0.
  std::set<std::size_t> counts;
  for (const planner::SweepRow& r : result.rows) counts.insert(r.segments);
  std::map<std::size_t, std::size_t> slot;
  for (const std::size_t k : counts) slot.emplace(k, slot.size());

  const auto value = [](const planner::SweepRow& r, bool smi) -> std::optional<double> {
    if (r.fits()) return static_cast<double>(smi ? r.figures.peak_device_used : r.figures.peak_allocated);
    if (r.unlimited) return static_cast<double>(smi ? r.unlimited->peak_device_used : r.unlimited->peak_allocated);
    return std::nullopt;
  };
  double max_bytes = static_cast<double>(result.device.total_bytes);
  for (const planner::SweepRow& r : result.rows) {
    for (const bool smi : {true, false}) {
      if (auto v = value(r, smi)) max_bytes = std::max(max_bytes, *v);
    }
  }
  // Keep the curves readable when the device dwarfs them (an 80 GB card, a small model).
  double data_max = 0;
  for (const planner::SweepRow& r : result.rows) {
    if (auto v = value(r, true)) data_max = std::max(data_max, *v);
  }
  const bool show_capacity = static_cast<double>(result.device.total_bytes) <= 3.0 * data_max;
  if (!show_capacity) max_bytes = data_max;
  const Axis axis = y_axis(max_bytes * 1.04);

  const double left = 90, right = 230, top = 56, bottom = 92;
  const double pw = width - left - right, ph = height - top - bottom;
  const auto x_of = [&](std::size_t k) {
    const double n = static_cast<double>(std::max<std::size_t>(slot.size(), 1));
    return left + pw * (static_cast<double>(slot.at(k)) + 0.5) / n;
  };
  const auto y_of = [&](double bytes) { return top + ph * (1.0 - bytes / axis.top); };

  std::string s = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n",
      width, height);
  s += fmt::format("<text x=\"{}\" y=\"24\" font-size=\"16\" font-weight=\"bold\">{}</text>\n", left,
                   xml_escape(fmt::format("Peak memory vs checkpoint segments — {}",
                                          model_title(result.model, result.spec.model_options,
                                                      result.spec.batches, result.spec.seqs))));
  s += fmt::format("<text x=\"{}\" y=\"42\" fill=\"#555\">{}</text>\n", left,
                   xml_escape(fmt::format("on {}; {} sequential modules, sqrt = {:.1f}; {} step(s) per configuration",
                                          result.device.name, result.model.sequence_length,
                                          std::sqrt(static_cast<double>(result.model.sequence_length)),
                                          result.spec.steps)));

  // Grid and y labels.
  for (double v = 0; v <= axis.top / axis.unit + 1e-9; v += axis.step) {
    const double y = y_of(v * axis.unit);
    s += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#e5e5e5\"/>\n",
                     left, y, left + pw, y);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{} {}</text>\n", left - 8,
                     y + 4, label_number(v), axis.name);
  }
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n",
                   left, top, pw, ph);
  for (const auto& [k, i] : slot) {
    const double x = x_of(k);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", x,
                     top + ph + 18, k);
  }
  s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">checkpoint segments (0 = none)</text>\n",
                   left + pw / 2, top + ph + 40);

  if (show_capacity) {
    const double y = y_of(static_cast<double>(result.device.total_bytes));
    s += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#d62728\" "
                     "stroke-width=\"1.5\" stroke-dasharray=\"8 4\"/>\n",
                     left, y, left + pw, y);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#d62728\">capacity {}</text>\n", left + 6,
                     y - 6, xml_escape(format_bytes(result.device.total_bytes)));
  }

  // One colour per group (dtype and allocator setting), in row order.
  std::vector<std::string> groups;
  for (const planner::SweepRow& r : result.rows) {
    const std::string g = r.label().substr(0, r.label().find(" seg ")) +
                          (r.alloc_conf.empty() ? "" : " [" + r.alloc_conf + "]");
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  }
  double legend_y = top + 10;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const char* colour = kColours[gi % kColours.size()];
    std::vector<const planner::SweepRow*> rows;
    for (const planner::SweepRow& r : result.rows) {
      const std::string g = r.label().substr(0, r.label().find(" seg ")) +
                            (r.alloc_conf.empty() ? "" : " [" + r.alloc_conf + "]");
      if (g == groups[gi]) rows.push_back(&r);
    }
    std::sort(rows.begin(), rows.end(), [](const planner::SweepRow* a, const planner::SweepRow* b) { return a->segments < b->segments; });
    for (const bool smi : {true, false}) {
      std::string points;
      for (const planner::SweepRow* r : rows) {
        if (auto v = value(*r, smi)) points += fmt::format("{:.1f},{:.1f} ", x_of(r->segments), y_of(*v));
      }
      s += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{} points=\"{}\"/>\n", colour,
                       smi ? "" : " stroke-dasharray=\"6 4\"", points);
      for (const planner::SweepRow* r : rows) {
        const auto v = value(*r, smi);
        if (!v) continue;
        const double x = x_of(r->segments), y = y_of(*v);
        if (r->fits()) {
          s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\"/>\n", x, y, colour);
        } else {
          s += fmt::format("<path d=\"M{:.1f},{:.1f} l10,10 m0,-10 l-10,10\" stroke=\"#d62728\" stroke-width=\"2.5\"/>\n",
                           x - 5, y - 5);
        }
        if (smi && r->best) {
          s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"9\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n"
                           "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" fill=\"{}\">best</text>\n",
                           x, y, colour, x, y - 14, colour);
        }
      }
    }
    const double lx = left + pw + 20;
    s += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"{3}\" stroke-width=\"2\"/>"
                     "<text x=\"{4:.1f}\" y=\"{5:.1f}\">{6} max nvidia-smi</text>\n",
                     lx, legend_y, lx + 28, colour, lx + 34, legend_y + 4, xml_escape(groups[gi]));
    legend_y += 20;
    s += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"{3}\" stroke-width=\"2\" "
                     "stroke-dasharray=\"6 4\"/><text x=\"{4:.1f}\" y=\"{5:.1f}\">{6} max allocated</text>\n",
                     lx, legend_y, lx + 28, colour, lx + 34, legend_y + 4, xml_escape(groups[gi]));
    legend_y += 28;
  }
  const double lx = left + pw + 20;
  s += fmt::format("<path d=\"M{:.1f},{:.1f} l10,10 m0,-10 l-10,10\" stroke=\"#d62728\" stroke-width=\"2.5\"/>"
                   "<text x=\"{:.1f}\" y=\"{:.1f}\">OOM: what it needs</text>\n",
                   lx + 9, legend_y - 5, lx + 34, legend_y + 4);
  const std::string footer = wrap("device: " + result.device.assumptions, "", "", 150);
  double fy = height - 36;
  for (std::size_t b = 0, e; b < footer.size(); b = e + 1) {
    e = footer.find('\n', b);
    s += fmt::format("<text x=\"{}\" y=\"{:.0f}\" fill=\"#555\" font-size=\"11\">{}</text>\n", left, fy,
                     xml_escape(footer.substr(b, e - b)));
    fy += 15;
  }
  s += "</svg>\n";
  return s;
}

}  // namespace mem::tools
