// export_svg.cpp — a Timeline as an SVG plot: allocated (area), reserved and
// nvidia-smi view (lines) over time, the peak marked, phases as shaded bands,
// axes in MiB/GiB, legend and title. Plain SVG 1.1, no scripts or fonts to load.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <vector>

#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/exports.hpp"

namespace mem {
namespace {

constexpr const char* kFont = "Helvetica, Arial, sans-serif";
constexpr const char* kAllocatedColor = "#4e79a7";
constexpr const char* kReservedColor = "#f28e2c";
constexpr const char* kSmiColor = "#e15759";

struct PhaseStyle {
  Phase phase;
  const char* color;
  double opacity;
};
// Drawn in this order: recompute sits inside backward, so it goes on top.
constexpr std::array<PhaseStyle, 4> kPhaseStyles = {{
    {Phase::Forward, "#59a14f", 0.13},
    {Phase::Backward, "#af7aa1", 0.15},
    {Phase::Optimizer, "#76b7b2", 0.22},
    {Phase::Recompute, "#edc949", 0.30},
}};

struct Scale {
  double from_lo, from_hi, to_lo, to_hi;
  double operator()(double v) const {
    return to_lo + (v - from_lo) / (from_hi - from_lo) * (to_hi - to_lo);
  }
};

// 1, 2, 2.5, 5 x 10^k: the step that gives about `target` ticks over `span`.
double nice_step(double span, int target) {
  const double raw = span / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * magnitude >= raw) return m * magnitude;
  }
  return 10 * magnitude;
}

struct ByteUnit {
  double bytes;
  const char* name;
};
ByteUnit byte_unit(double max_bytes) {
  if (max_bytes >= 2.0 * GiB) return {static_cast<double>(GiB), "GiB"};
  if (max_bytes >= 2.0 * MiB) return {static_cast<double>(MiB), "MiB"};
  if (max_bytes >= 2.0 * KiB) return {static_cast<double>(KiB), "KiB"};
  return {1.0, "B"};
}

struct TimeUnit {
  double us;
  const char* name;
};
TimeUnit time_unit(double max_us, TimelineClock clock) {
  if (clock == TimelineClock::Events) {
    if (max_us >= 2e6) return {1e6, "millions"};
    if (max_us >= 2e4) return {1e3, "thousands"};
    return {1.0, ""};
  }
  if (max_us >= 2e6) return {1e6, "s"};
  if (max_us >= 2e3) return {1e3, "ms"};
  return {1.0, "\xC2\xB5s"};  // µs
}

// The title on as many lines as it needs at ~10 px a character (20 px bold).
std::vector<std::string> wrap_title(const std::string& title, double width_px) {
  const auto per_line = static_cast<std::size_t>(std::max(20.0, width_px / 10.5));
  std::vector<std::string> lines{""};
  std::size_t pos = 0;
  while (pos < title.size()) {
    std::size_t next = title.find(' ', pos);
    if (next == std::string::npos) next = title.size();
    const std::string word = title.substr(pos, next - pos);
    if (!lines.back().empty() && lines.back().size() + 1 + word.size() > per_line) lines.emplace_back();
    if (!lines.back().empty()) lines.back() += ' ';
    lines.back() += word;
    pos = next + 1;
  }
  return lines;
}

std::string trim_number(double v) {
  std::string s = fmt::format("{:.2f}", v);
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

// A step line through the samples, reduced to at most a few points per pixel
// column (the column's min, max and last value), so a million events stay small.
std::string step_path(const std::vector<TimelineSample>& samples, const Scale& x, const Scale& y,
                      const std::function<std::size_t(const TimelineSample&)>& value,
                      double x_end) {
  std::string d;
  if (samples.empty()) return d;
  d += fmt::format("M{:.1f},{:.1f}", x(samples.front().time_us), y(double(value(samples.front()))));
  std::size_t i = 1;
  while (i < samples.size()) {
    const double column = std::floor(x(samples[i].time_us));
    double lo = double(value(samples[i])), hi = lo, last = lo;
    std::size_t j = i + 1;
    while (j < samples.size() && std::floor(x(samples[j].time_us)) == column) {
      const double v = double(value(samples[j]));
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      last = v;
      ++j;
    }
    const double px = x(samples[i].time_us);
    d += fmt::format("H{:.1f}", px);
    if (hi != lo) d += fmt::format("V{:.1f}V{:.1f}", y(lo), y(hi));
    d += fmt::format("V{:.1f}", y(last));
    i = j;
  }
  d += fmt::format("H{:.1f}", x_end);
  return d;
}

struct Band {
  double begin, end;
};

// Union of the slices of one phase, bridging gaps too small to see.
std::vector<Band> phase_bands(const std::vector<TimelineSlice>& slices, Phase phase, double end_us,
                              double min_gap) {
  std::vector<Band> raw;
  for (const TimelineSlice& s : slices) {
    if (context_info(s.context).phase != phase) continue;
    raw.push_back({s.begin_us, s.end_us < 0 ? end_us : s.end_us});
  }
  std::sort(raw.begin(), raw.end(), [](const Band& a, const Band& b) { return a.begin < b.begin; });
  std::vector<Band> merged;
  for (const Band& b : raw) {
    if (!merged.empty() && b.begin <= merged.back().end + min_gap) {
      merged.back().end = std::max(merged.back().end, b.end);
    } else {
      merged.push_back(b);
    }
  }
  return merged;
}

}  // namespace

std::string memory_plot_svg(const Timeline& timeline, const PlotOptions& options) {
  const int width = std::max(options.width, 480);
  const int height = std::max(options.height, 320);
  const auto samples = timeline.samples();
  const auto slices = timeline.slices();
  const double end_us = std::max(timeline.end_us(), 1.0);
  const DeviceInfo& device = timeline.device_info();

  // Plot area, below the title's lines.
  const std::string title =
      options.title.empty() ? "Memory over one run \xE2\x80\x94 " + device.name : options.title;
  const std::vector<std::string> title_lines = wrap_title(title, width - 88.0 - 28.0);
  const double title_extra = 24.0 * static_cast<double>(title_lines.size() - 1);
  const double left = 88, right = width - 28.0, top = 84 + title_extra, bottom = height - 96.0;

  // Peaks.
  std::size_t peak_alloc = 0, peak_reserved = 0, peak_smi = 0;
  double peak_alloc_t = 0;
  for (const TimelineSample& s : samples) {
    if (s.allocated_bytes > peak_alloc) {
      peak_alloc = s.allocated_bytes;
      peak_alloc_t = s.time_us;
    }
    peak_reserved = std::max(peak_reserved, s.reserved_bytes);
    peak_smi = std::max(peak_smi, s.device_used_bytes);
  }
  const std::size_t total = timeline.device_total_bytes();
  double max_bytes = std::max<double>({double(peak_alloc), double(peak_reserved), double(peak_smi),
                                       double(MiB)});
  // Show the capacity when the run comes near it: "does it fit" is the question.
  const bool show_capacity = total > 0 && max_bytes > 0.6 * double(total);
  if (show_capacity) max_bytes = std::max(max_bytes, double(total));

  const ByteUnit unit = byte_unit(max_bytes);
  const double y_step = nice_step(max_bytes * 1.05 / unit.bytes, 5);
  const double y_top = std::ceil(max_bytes * 1.05 / unit.bytes / y_step) * y_step * unit.bytes;
  const Scale y{0, y_top, bottom, top};
  const TimeUnit tunit = time_unit(end_us, timeline.clock());
  const double x_step = nice_step(end_us / tunit.us, 8);
  const Scale x{0, end_us, left, right};

  std::string svg;
  svg += fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"{2}\">\n",
      width, height, kFont);
  svg += fmt::format("<!-- vramscope memory plot, version {} -->\n", kSvgPlotVersion);
  svg += fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", width,
                     height);

  // Title and the one-line story of the run.
  for (std::size_t i = 0; i < title_lines.size(); ++i) {
    svg += fmt::format(
        "<text x=\"{}\" y=\"{}\" font-size=\"20\" font-weight=\"bold\" fill=\"#222\">{}</text>\n",
        left, 34 + 24 * i, xml_escape(title_lines[i]));
  }
  std::string story = fmt::format("peak allocated {} \xC2\xB7 peak reserved {} \xC2\xB7 peak nvidia-smi {}",
                                  format_bytes(peak_alloc), format_bytes(peak_reserved),
                                  format_bytes(peak_smi));
  if (device.context_bytes > 0) story += fmt::format(" (incl. {} CUDA context)", format_bytes(device.context_bytes));
  if (total > 0) story += fmt::format(" \xC2\xB7 device {}", format_bytes(total));
  svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"13\" fill=\"#555\">{}</text>\n", left,
                     58 + title_extra, xml_escape(story));

  // Plot background, then phase bands under everything else.
  svg += fmt::format(
      "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#fbfbfd\" stroke=\"none\"/>\n",
      left, top, right - left, bottom - top);
  svg += "<g id=\"phases\">\n";
  for (const PhaseStyle& style : kPhaseStyles) {
    for (const Band& band : phase_bands(slices, style.phase, end_us, end_us * 0.004)) {
      const double bx = x(band.begin), bw = std::max(1.0, x(band.end) - bx);
      svg += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\" "
          "fill-opacity=\"{}\"><title>{}</title></rect>\n",
          bx, top, bw, bottom - top, style.color, style.opacity, phase_name(style.phase));
      const std::string_view label = phase_name(style.phase);
      if (bw > 8.0 * double(label.size()) + 8) {
        svg += fmt::format(
            "<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\" fill=\"#444\" text-anchor=\"middle\" "
            "opacity=\"0.85\">{}</text>\n",
            bx + bw / 2, top + 14, label);
      }
    }
  }
  svg += "</g>\n";

  // Grid and axes.
  svg += "<g id=\"y-axis\" font-size=\"12\" fill=\"#555\">\n";
  for (double v = 0; v <= y_top / unit.bytes + 1e-9; v += y_step) {
    const double py = y(v * unit.bytes);
    svg += fmt::format(
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#e3e3e8\" "
        "stroke-width=\"1\"/>\n",
        left, py, right, py);
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{} {}</text>\n", left - 8,
                       py + 4, trim_number(v), unit.name);
  }
  svg += "</g>\n<g id=\"x-axis\" font-size=\"12\" fill=\"#555\">\n";
  for (double v = 0; v <= end_us / tunit.us + 1e-9; v += x_step) {
    const double px = x(v * tunit.us);
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#888\" "
        "stroke-width=\"1\"/>\n",
        px, bottom, bottom + 5);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", px,
                       bottom + 19, trim_number(v));
  }
  svg += fmt::format(
      "<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\" font-size=\"12\" fill=\"#555\">"
      "{} since recording started{}</text>\n",
      (left + right) / 2, bottom + 38,
      timeline.clock() == TimelineClock::Events ? "allocator events" : "time",
      *tunit.name == '\0' ? std::string() : fmt::format(" ({})", tunit.name));
  svg += "</g>\n";
  svg += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#888\" stroke-width=\"1\"/>\n"
      "<line x1=\"{0}\" y1=\"{2}\" x2=\"{3}\" y2=\"{2}\" stroke=\"#888\" stroke-width=\"1\"/>\n",
      left, top, bottom, right);

  if (show_capacity) {
    const double py = y(double(total));
    svg += fmt::format(
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#b22222\" stroke-width=\"1.5\" "
        "stroke-dasharray=\"8 4\"/>\n"
        "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" font-size=\"11\" fill=\"#b22222\">"
        "device capacity {}</text>\n",
        left, py, right, py, right - 4, py - 5, format_bytes(total));
  }

  // Series: allocated as a filled area, reserved and the nvidia-smi view as lines.
  const auto allocated = [](const TimelineSample& s) { return s.allocated_bytes; };
  const auto reserved = [](const TimelineSample& s) { return s.reserved_bytes; };
  const auto smi = [](const TimelineSample& s) { return s.device_used_bytes; };
  const std::string alloc_path = step_path(samples, x, y, allocated, right);
  if (!alloc_path.empty()) {
    svg += fmt::format(
        "<path id=\"allocated-area\" d=\"{}V{:.1f}H{:.1f}Z\" fill=\"{}\" fill-opacity=\"0.22\" "
        "stroke=\"none\"/>\n",
        alloc_path, bottom, x(samples.front().time_us), kAllocatedColor);
    svg += fmt::format(
        "<path id=\"allocated\" d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\" "
        "stroke-linejoin=\"round\"/>\n",
        alloc_path, kAllocatedColor);
    svg += fmt::format(
        "<path id=\"reserved\" d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\" "
        "stroke-linejoin=\"round\"/>\n",
        step_path(samples, x, y, reserved, right), kReservedColor);
    svg += fmt::format(
        "<path id=\"nvidia-smi\" d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\" "
        "stroke-dasharray=\"6 3\" stroke-linejoin=\"round\"/>\n",
        step_path(samples, x, y, smi, right), kSmiColor);
  }

  // Out of memory: where the allocator gave up, and what was asked.
  for (const TimelineOom& oom : timeline.ooms()) {
    const double px = x(oom.time_us);
    svg += fmt::format(
        "<g id=\"oom\">\n<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#b22222\" "
        "stroke-width=\"2\"/>\n<text x=\"{3:.1f}\" y=\"{4}\" font-size=\"12\" font-weight=\"bold\" "
        "fill=\"#b22222\" text-anchor=\"end\" stroke=\"#ffffff\" stroke-width=\"4\" "
        "paint-order=\"stroke\">out of memory: asked {5} with {6} allocated</text>\n</g>\n",
        px, top, bottom, px - 4, top + 30, format_bytes(oom.requested_bytes),
        format_bytes(oom.allocated_bytes));
  }

  // The peak: a marker, a guide to the axis, and its value.
  if (peak_alloc > 0) {
    const double px = x(peak_alloc_t), py = y(double(peak_alloc));
    const bool label_left = px > (left + right) / 2;
    svg += fmt::format(
        "<g id=\"peak\">\n"
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"1\" "
        "stroke-dasharray=\"2 3\"/>\n"
        "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"5\" fill=\"#ffffff\" stroke=\"{}\" "
        "stroke-width=\"2.5\"/>\n"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"12\" font-weight=\"bold\" fill=\"{}\" "
        "text-anchor=\"{}\" stroke=\"#ffffff\" stroke-width=\"4\" stroke-linejoin=\"round\" "
        "paint-order=\"stroke\">peak allocated {}</text>\n</g>\n",
        left, py, px, py, kAllocatedColor, px, py, kAllocatedColor,
        label_left ? px - 10 : px + 10, py - 9, kAllocatedColor, label_left ? "end" : "start",
        format_bytes(peak_alloc));
  }

  // Legend under the axis label: series first, then the phases that occur.
  double lx = left;
  const double ly = bottom + 62;
  svg += "<g id=\"legend\" font-size=\"12\" fill=\"#333\">\n";
  auto line_entry = [&](const char* color, const char* dash, const char* label, bool area) {
    if (area) {
      svg += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"22\" height=\"10\" fill=\"{}\" "
          "fill-opacity=\"0.22\"/>\n",
          lx, ly - 9, color);
    }
    svg += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" "
        "stroke-width=\"2\"{}/>\n",
        lx, area ? ly - 9 : ly - 4, lx + 22, area ? ly - 9 : ly - 4, color,
        dash[0] ? fmt::format(" stroke-dasharray=\"{}\"", dash) : std::string());
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", lx + 28, ly, label);
    lx += 28 + 7.0 * double(std::string_view(label).size()) + 22;
  };
  line_entry(kAllocatedColor, "", "allocated", true);
  line_entry(kReservedColor, "", "reserved", false);
  line_entry(kSmiColor, "6 3", "nvidia-smi view", false);
  for (const PhaseStyle& style : kPhaseStyles) {
    const bool present = std::any_of(slices.begin(), slices.end(), [&](const TimelineSlice& s) {
      return context_info(s.context).phase == style.phase;
    });
    if (!present) continue;
    const std::string_view label = phase_name(style.phase);
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"12\" fill=\"{}\" "
        "fill-opacity=\"{}\" stroke=\"{}\" stroke-opacity=\"0.5\"/>\n",
        lx, ly - 10, style.color, std::min(1.0, style.opacity * 2.5), style.color);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", lx + 20, ly, label);
    lx += 20 + 7.0 * double(label.size()) + 18;
  }
  svg += "</g>\n";

  // The simulated device's assumptions: every figure above depends on them.
  if (!device.assumptions.empty()) {
    std::string note = device.assumptions;
    const std::size_t max_chars = static_cast<std::size_t>((width - left) / 5.6);
    if (note.size() > max_chars) note = note.substr(0, max_chars - 3) + "...";
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10.5\" fill=\"#888\">{}</text>\n", left,
                       height - 10, xml_escape(note));
  }
  svg += "</svg>\n";
  return svg;
}

void write_memory_plot_svg(const Timeline& timeline, const std::filesystem::path& path,
                           const PlotOptions& options) {
  write_output_file(path, memory_plot_svg(timeline, options), "mem::write_memory_plot_svg");
}

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace mem
