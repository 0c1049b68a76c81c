// trace_reader.cpp — PyTorch snapshots, vramscope history CSV and RMM logging
// CSV read into one AllocationTrace shape for replay.
#include "vramscope/replay/trace_reader.hpp"
#include "vramscope/instrumentation/exports.hpp"
#include "vramscope/instrumentation/files.hpp"
#include "vramscope/instrumentation/module_scope.hpp"

#include "mapped_file.hpp"
#include "snapshot_scanner.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <istream>
#include <map>
#include <optional>
#include <unordered_map>

#include "vramscope/allocator/errors.hpp"

namespace mem {

namespace {

/// GPUs a snapshot may name: CUDA device indices, well past any node's count.
constexpr std::int64_t kMaxRecordedDevices = 4096;

constexpr std::array<std::string_view, 9> kActionNames = {
    "alloc",       "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap",  "oom",            "snapshot"};

std::optional<RecordedAction> action_from_name(std::string_view name) {
  for (std::size_t i = 0; i < kActionNames.size(); ++i)
    if (kActionNames[i] == name) return static_cast<RecordedAction>(i);
  return std::nullopt;
}

std::string list_actions() {
  std::string s;
  for (auto n : kActionNames) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

// --- snapshot pickles ------------------------------------------------------------

// Runs f(), prefixing any mem::Error with where in the snapshot it happened.
template <class F>
auto at_path(const std::string& path, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

/// A directory opens as a stream (what reading it gives depends on the C++ library), a
/// named pipe waits for a writer: say what it is before reading.
void check_trace_file(const std::string& path) { check_input_file(path, "the trace"); }

BlockState block_state_from(std::string_view s, const std::string& path) {
  if (s == "active_allocated") return BlockState::ActiveAllocated;
  if (s == "active_pending_free") return BlockState::ActivePendingFree;
  if (s == "inactive") return BlockState::Inactive;
  throw Error(path + ": unknown block state '" + std::string(s) +
              "' (expected active_allocated, active_pending_free or inactive)");
}

/// A segment of the snapshot; its blocks from the scanner when it read them (`scanned`).
RecordedSegment read_segment(const PickleValue& seg, const std::string& path,
                             const detail::ScannedSnapshot* scanned) {
  return at_path(path, [&] {
    RecordedSegment s;
    s.address = seg.at("address").as_size();
    s.total_size = seg.at("total_size").as_size();
    if (const PickleValue* v = seg.find("device")) {
      // A CUDA device index: PyTorch writes the segment's GPU, 0 and up.
      const std::int64_t d = v->as_int();
      if (d < 0 || d >= kMaxRecordedDevices) {
        throw Error("device " + std::to_string(d) + " is not a GPU index (0 to " +
                    std::to_string(kMaxRecordedDevices - 1) + ")");
      }
      s.device = static_cast<int>(d);
    }
    if (const PickleValue* v = seg.find("stream")) s.stream = static_cast<std::uint64_t>(v->as_int());
    if (const PickleValue* v = seg.find("segment_type")) {
      s.small_pool = v->as_string() == "small";
    } else {
      s.small_pool = s.total_size == kSmallBuffer;
    }
    if (const PickleValue* v = seg.find("is_expandable")) s.expandable = v->as_bool();
    const PickleValue& blocks_value = seg.at("blocks");
    const PickleList& blocks = blocks_value.as_list();
    // Old snapshots have no block addresses: blocks tile the segment in order.
    std::uintptr_t cursor = s.address;
    const std::vector<detail::ScannedBlock>* read = nullptr;
    if (scanned != nullptr) {
      if (auto it = scanned->blocks.find(blocks_value.identity()); it != scanned->blocks.end()) read = &it->second;
    }
    if (read != nullptr) {
      s.blocks.reserve(read->size());
      for (const detail::ScannedBlock& scanned_block : *read) {
        RecordedBlock b = scanned_block.block;
        if (!scanned_block.has_address) b.address = cursor;
        cursor = b.address + b.size;
        s.blocks.push_back(b);
      }
    }
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      try {
        RecordedBlock b;
        b.size = blocks[i].at("size").as_size();
        b.address = blocks[i].find("address") ? blocks[i].at("address").as_size() : cursor;
        if (const PickleValue* r = blocks[i].find("requested_size")) b.requested_size = r->as_size();
        b.state = block_state_from(blocks[i].at("state").as_string(), "state");
        cursor = b.address + b.size;
        s.blocks.push_back(b);
      } catch (const Error& e) {
        throw Error("blocks[" + std::to_string(i) + "]: " + e.what());  // the path only when needed
      }
    }
    std::sort(s.blocks.begin(), s.blocks.end(),
              [](const RecordedBlock& a, const RecordedBlock& b) { return a.address < b.address; });
    return s;
  });
}

/// The distinct frame lists of a snapshot's events, interned by the list's identity: the
/// pickle's memo shares one list among the events that have it, and so does the reader.
class StackTable {
 public:
  explicit StackTable(std::vector<std::string>& out) : out_(out) {}
  std::uint32_t intern(const PickleValue& frames) {
    if (!frames.is_sequence() || frames.as_list().empty()) return 0;
    const PickleList& list = frames.as_list();
    const auto [at, fresh] = ids_.emplace(&list, 0);
    if (!fresh) return at->second;
    // A list the pickle did not share (a writer without the memo) may still repeat a stack.
    std::string text = render(list);
    const auto [by_text, added] = by_text_.emplace(text, static_cast<std::uint32_t>(out_.size() + 1));
    if (added) out_.push_back(std::move(text));
    at->second = by_text->second;
    return at->second;
  }

 private:
  /// The frames a user reads first: PyTorch records the allocator's own C++ frames
  /// (torch::unwind, CUDACachingAllocator) and torch's Python below the user's code, so
  /// the user's Python frames come first, then any Python, then whatever there is.
  static int rank(const PickleValue& frame) {
    const PickleValue* file = frame.is_dict() ? frame.find("filename") : nullptr;
    if (file == nullptr || !file->is_string()) return 3;
    const std::string& f = file->as_string();
    const bool python = f.size() > 3 && f.compare(f.size() - 3, 3, ".py") == 0;
    if (!python) return 2;
    return f.find("/torch/") == std::string::npos && f.find("site-packages/") == std::string::npos ? 0 : 1;
  }

  static std::string render(const PickleList& list) {
    int best = 3;
    for (const PickleValue& f : list) best = std::min(best, rank(f));
    std::string text;
    std::size_t shown = 0;
    for (std::size_t i = 0; i < list.size() && shown < AllocationTrace::kStackFrames; ++i) {
      const PickleValue& f = list[i];
      if (!f.is_dict() || rank(f) != best) continue;
      ++shown;
      const PickleValue* name = f.find("name");
      const PickleValue* file = f.find("filename");
      const PickleValue* line = f.find("line");
      if (!text.empty()) text += " <- ";
      text += name && name->is_string() ? name->as_string() : "?";
      text += " (";
      text += file && file->is_string() ? file->as_string() : std::string("?");
      if (line && line->is_int()) {
        text += ':';
        text += std::to_string(line->as_int());
      }
      text += ")";
      if (text.size() > AllocationTrace::kStackChars) break;
    }
    if (text.size() > AllocationTrace::kStackChars) text.resize(AllocationTrace::kStackChars);
    return text;
  }

  std::vector<std::string>& out_;
  std::unordered_map<const PickleList*, std::uint32_t> ids_;
  std::unordered_map<std::string, std::uint32_t> by_text_;
};

RecordedEvent read_event_fields(const PickleValue& ev, StackTable& stacks) {
  RecordedEvent e;
  if (const PickleValue* f = ev.find("frames")) e.stack = stacks.intern(*f);
  const std::string& name = ev.at("action").as_string();
  auto action = action_from_name(name);
  if (!action) throw Error("unknown action '" + name + "' (expected one of " + list_actions() + ")");
  e.action = *action;
  // PyTorch writes an oom entry's address field as `device_free` (the driver's free
  // bytes at the failure; torch/csrc/cuda/Module.cpp) and no `addr`: it has no block.
  if (e.action != RecordedAction::Oom) e.address = static_cast<std::uintptr_t>(ev.at("addr").as_int());
  e.size = ev.at("size").as_size();
  if (const PickleValue* v = ev.find("stream")) e.stream = static_cast<std::uint64_t>(v->as_int());
  if (const PickleValue* v = ev.find("time_us"); v && !v->is_none()) e.time_us = v->as_float();
  return e;
}

/// device_traces[d][i]: `base` and `i` make its path only when an error names it (a
/// snapshot has a million events and, as a rule, no error).
RecordedEvent read_event(const PickleValue& ev, const std::string& base, std::size_t i, StackTable& stacks) {
  try {
    return read_event_fields(ev, stacks);
  } catch (const Error& e) {
    throw Error(base + "[" + std::to_string(i) + "]: " + e.what());
  }
}
void finish(AllocationTrace& t) {
  for (const RecordedEvent& e : t.events) {
    if (e.action == RecordedAction::FreeCompleted) t.has_free_completed = true;
    if (e.action == RecordedAction::SegmentMap || e.action == RecordedAction::SegmentUnmap)
      t.expandable_segments = true;
  }
  for (const RecordedSegment& s : t.final_segments)
    if (s.expandable) t.expandable_segments = true;
}

// --- CSV -----------------------------------------------------------------------------

// Splits one CSV record (RFC 4180 quoting; no embedded newlines).
std::vector<std::string> split_csv(std::string_view line, const std::string& where) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          fields.back().push_back('"');
          ++i;
        } else {
          quoted = false;
        }
      } else {
        fields.back().push_back(c);
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else if (c != '\r') {
      fields.back().push_back(c);
    }
  }
  if (quoted) throw Error(where + ": unterminated quoted field");
  return fields;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Decimal or 0x-prefixed hexadecimal unsigned integer.
std::uint64_t parse_uint(std::string_view text, std::string_view column, const std::string& where) {
  std::string_view s = trim(text);
  int base = 10;
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s.remove_prefix(2);
    base = 16;
  }
  std::uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
  if (s.empty() || ec != std::errc{} || end != s.data() + s.size())
    throw Error(where + ": column " + std::string(column) + ": '" + std::string(text) +
                "' is not a non-negative integer (decimal or 0x hex)");
  return v;
}

double parse_double(std::string_view text, std::string_view column, const std::string& where) {
  const std::string s(trim(text));
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size())
    throw Error(where + ": column " + std::string(column) + ": '" + std::string(text) +
                "' is not a number");
  return v;
}

struct CsvTable {
  std::vector<std::string> header;
  std::size_t column(std::string_view name, const std::string& source) const {
    for (std::size_t i = 0; i < header.size(); ++i)
      if (trim(header[i]) == name) return i;
    std::string have;
    for (const auto& h : header) have += (have.empty() ? "" : ",") + h;
    throw Error(source + ": line 1: missing column '" + std::string(name) + "' (header is '" +
                have + "')");
  }
};

// Calls row(fields, where) for each non-empty data line; returns the header.
template <class Row>
CsvTable read_csv(std::istream& in, const std::string& source, Row&& row) {
  CsvTable t;
  std::string line;
  std::size_t lineno = 0;
  while (read_line(in, line, source, lineno + 1)) {
    ++lineno;
    if (trim(line).empty() || trim(line) == "\r") continue;
    const std::string where = source + ": line " + std::to_string(lineno);
    if (t.header.empty()) {
      t.header = split_csv(line, where);
      continue;
    }
    auto fields = split_csv(line, where);
    if (fields.size() != t.header.size())
      throw Error(where + ": " + std::to_string(fields.size()) + " fields, the header has " +
                  std::to_string(t.header.size()));
    row(t, fields, where);
  }
  // getline stops on a read error as on the end: never take one for the other.
  if (in.bad()) throw Error(source + ": read error after line " + std::to_string(lineno));
  if (t.header.empty()) throw Error(source + ": empty file (expected a CSV header)");
  return t;
}

// RMM writes Time as seconds since the epoch, older versions as HH:MM:SS:us.
double parse_rmm_time(std::string_view text, const std::string& where) {
  std::string_view s = trim(text);
  if (s.find(':') == std::string_view::npos) return parse_double(s, "Time", where) * 1e6;
  double parts[4] = {0, 0, 0, 0};
  std::size_t n = 0;
  while (!s.empty()) {
    if (n == 4) throw Error(where + ": column Time: '" + std::string(text) + "' is not HH:MM:SS:us");
    const std::size_t colon = s.find(':');
    parts[n++] = parse_double(s.substr(0, colon), "Time", where);
    s = colon == std::string_view::npos ? std::string_view{} : s.substr(colon + 1);
  }
  if (n < 3) throw Error(where + ": column Time: '" + std::string(text) + "' is not HH:MM:SS:us");
  return ((parts[0] * 60 + parts[1]) * 60 + parts[2]) * 1e6 + parts[3];
}

std::ifstream open_text(const std::string& path) {
  check_trace_file(path);
  std::ifstream in(path);
  if (!in) throw Error("cannot open '" + path + "' for reading");
  return in;
}

}  // namespace

std::string_view recorded_action_name(RecordedAction action) noexcept {
  const auto i = static_cast<std::size_t>(action);
  return i < kActionNames.size() ? kActionNames[i] : "?";
}

std::string_view trace_format_name(TraceFormat format) noexcept {
  switch (format) {
    case TraceFormat::PyTorchSnapshot: return "pytorch-snapshot";
    case TraceFormat::PyTorchSegmentList: return "pytorch-segment-list";
    case TraceFormat::HistoryCsv: return "vramscope-history-csv";
    case TraceFormat::RmmCsv: return "rmm-log-csv";
  }
  return "?";
}

std::vector<std::size_t> AllocationTrace::action_counts() const {
  std::vector<std::size_t> counts(kActionNames.size(), 0);
  for (const RecordedEvent& e : events) ++counts[static_cast<std::size_t>(e.action)];
  return counts;
}

namespace {
/// How many trace entries device_traces[d] holds (the scanner's count when it read them).
std::size_t trace_size(const PickleList& traces, std::size_t d, const detail::ScannedSnapshot* scanned) {
  if (scanned != nullptr) return d < scanned->device_ranges.size() ? scanned->device_ranges[d].second : 0;
  return traces[d].is_sequence() ? traces[d].as_list().size() : 0;
}

/// read_pytorch_snapshot, with the trace entries already read by the scanner when `scanned`.
AllocationTrace read_snapshot(const PickleValue& root, int device, const std::string& source,
                              detail::ScannedSnapshot* scanned) {
  AllocationTrace t;
  t.source = source;
  const PickleList* segments = nullptr;
  const PickleList* traces = nullptr;
  if (root.is_dict()) {
    t.format = TraceFormat::PyTorchSnapshot;
    if (!root.find("segments"))
      throw Error(source + ": not a memory snapshot: the dict has no 'segments' key");
    segments = &at_path(source + ": segments", [&]() -> const PickleList& {
      return root.at("segments").as_list();
    });
    if (const PickleValue* d = root.find("device_traces"))
      traces = &at_path(source + ": device_traces", [&]() -> const PickleList& { return d->as_list(); });
    if (const PickleValue* s = root.find("allocator_settings"); s && s->is_dict()) {
      t.allocator_conf_known = true;
      if (const PickleValue* c = s->find("PYTORCH_CUDA_ALLOC_CONF"); c && c->is_string())
        t.allocator_conf = c->as_string();
      if (const PickleValue* e = s->find("expandable_segments"); e && e->as_bool())
        t.expandable_segments = true;
    }
  } else if (root.is_sequence()) {
    t.format = TraceFormat::PyTorchSegmentList;
    segments = &root.as_list();
  } else {
    throw Error(source + ": not a memory snapshot: the pickle holds a " +
                std::string(root.kind_name()) + ", expected a dict or a list of segments");
  }

  // What each GPU holds: its segments and its trace entries. The default is the busiest by
  // both together (a GPU with every segment and one trace entry beats one with one entry and
  // nothing else); a GPU asked for that holds nothing is an error naming those that do (below).
  std::map<int, std::pair<std::size_t, std::size_t>> held;  // device -> (segments, trace entries)
  for (const PickleValue& seg : *segments) {
    if (const PickleValue* d = seg.find("device"); d && d->is_int() && d->as_int() >= 0 && d->as_int() < kMaxRecordedDevices) {
      ++held[static_cast<int>(d->as_int())].first;
    }
  }
  if (traces) {
    for (std::size_t d = 0; d < traces->size(); ++d) {
      if (const std::size_t n = trace_size(*traces, d, scanned); n > 0) held[static_cast<int>(d)].second += n;
    }
  }
  if (device < 0) {
    device = 0;
    std::size_t most = 0;
    for (const auto& [d, n] : held) {
      if (n.first + n.second > most) most = n.first + n.second, device = d;
    }
  }
  t.device = device;

  t.has_final_state = true;
  for (std::size_t i = 0; i < segments->size(); ++i) {
    RecordedSegment s = read_segment((*segments)[i], source + ": segments[" + std::to_string(i) + "]", scanned);
    if (s.device == device) t.final_segments.push_back(std::move(s));
  }
  std::sort(t.final_segments.begin(), t.final_segments.end(),
            [](const RecordedSegment& a, const RecordedSegment& b) { return a.address < b.address; });

  if (scanned != nullptr && traces != nullptr && static_cast<std::size_t>(device) < scanned->device_ranges.size()) {
    // The scanner's events, in place: the chosen GPU's range, stacks from its frames lists.
    const auto [first, count] = scanned->device_ranges[static_cast<std::size_t>(device)];
    t.events = std::move(scanned->events);
    t.events.erase(t.events.begin() + static_cast<std::ptrdiff_t>(first + count), t.events.end());
    t.events.erase(t.events.begin(), t.events.begin() + static_cast<std::ptrdiff_t>(first));
    StackTable stacks{t.stacks};
    std::vector<std::uint32_t> stack_of(scanned->frames.size() + 1, UINT32_MAX);
    for (RecordedEvent& e : t.events) {
      if (e.stack == 0) continue;
      std::uint32_t& id = stack_of[e.stack];
      if (id == UINT32_MAX) id = stacks.intern(scanned->frames[e.stack - 1]);
      e.stack = id;
    }
  } else if (traces && static_cast<std::size_t>(device) < traces->size()) {
    const std::string base = source + ": device_traces[" + std::to_string(device) + "]";
    const PickleList& events =
        at_path(base, [&]() -> const PickleList& { return (*traces)[device].as_list(); });
    t.events.reserve(events.size());
    StackTable stacks{t.stacks};
    for (std::size_t i = 0; i < events.size(); ++i)
      t.events.push_back(read_event(events[i], base, i, stacks));
  }
  if (t.events.empty() && t.final_segments.empty()) {
    // Nothing on this device: say which devices have something, rather than replay zeros.
    std::string list;
    std::size_t listed = 0;
    for (const auto& [d, n] : held) {
      if (d == device || (n.first == 0 && n.second == 0)) continue;
      ++listed;
      list += (list.empty() ? "" : ", ") + std::string("device ") + std::to_string(d) + " (" + std::to_string(n.first) +
              " segments, " + std::to_string(n.second) + " trace events)";
    }
    if (!list.empty()) {
      throw Error(source + ": device " + std::to_string(device) + " has no segments and no trace events; " + list +
                  (listed == 1 ? " has them" : " have them") + " (vramscope replay --trace-device N)");
    }
  }
  finish(t);
  return t;
}
}  // namespace

AllocationTrace read_pytorch_snapshot(const PickleValue& root, int device, const std::string& source) {
  return read_snapshot(root, device, source, nullptr);
}

AllocationTrace read_pytorch_snapshot_file(const std::string& path, int device) {
  check_trace_file(path);  // before the mapping opens it: a FIFO would block
  // The fast path reads what PyTorch writes, from the mapped file, keeping only a window of
  // it resident; anything else (and every error) goes through the generic reader, whose
  // messages name the element at fault.
  if (auto mapped = detail::MappedFile::open(path)) {
    std::optional<detail::ScannedSnapshot> scanned =
        detail::scan_snapshot(mapped->bytes(), [&](const char* upto) { mapped->release_before(upto); });
    mapped.reset();
    if (scanned) return read_snapshot(scanned->root, device, path, &*scanned);
  }
  std::string data = read_pickle_bytes(path);
  PickleValue root;
  try {
    root = read_pickle(data);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
  std::string().swap(data);
  return read_snapshot(root, device, path, nullptr);
}

AllocationTrace read_history_trace(std::istream& in, const std::string& source) {
  AllocationTrace t;
  t.source = source;
  t.format = TraceFormat::HistoryCsv;
  struct Cols { std::size_t time, action, address, size, requested, stream; };
  std::optional<Cols> cols;
  read_csv(in, source, [&](const CsvTable& table, const std::vector<std::string>& f,
                           const std::string& where) {
    if (!cols) {
      cols = Cols{table.column("time_us", source), table.column("action", source),
                  table.column("address", source), table.column("size", source),
                  table.column("requested_size", source), table.column("stream", source)};
    }
    RecordedEvent e;
    const std::string_view name = trim(f[cols->action]);
    auto action = action_from_name(name);
    if (!action)
      throw Error(where + ": column action: unknown action '" + std::string(name) +
                  "' (expected one of " + list_actions() + ")");
    e.action = *action;
    e.time_us = trim(f[cols->time]).empty() ? 0.0 : parse_double(f[cols->time], "time_us", where);
    e.address = static_cast<std::uintptr_t>(parse_uint(f[cols->address], "address", where));
    const std::uint64_t size = parse_uint(f[cols->size], "size", where);
    const std::uint64_t requested =
        trim(f[cols->requested]).empty() ? 0 : parse_uint(f[cols->requested], "requested_size", where);
    const bool block_event = e.action == RecordedAction::Alloc ||
                             e.action == RecordedAction::FreeRequested ||
                             e.action == RecordedAction::FreeCompleted;
    e.size = block_event && requested > 0 ? requested : size;
    e.stream = parse_uint(f[cols->stream], "stream", where);
    t.events.push_back(e);
  });
  finish(t);
  return t;
}

AllocationTrace read_history_trace_file(const std::string& path) {
  auto in = open_text(path);
  return read_history_trace(in, path);
}

std::vector<HistoryEntry> read_history_csv(const std::filesystem::path& path) {
  const std::string source = path.string();
  auto in = open_text(source);
  const auto check_header = [&](const CsvTable& table) {
    std::string header;
    for (const std::string& h : table.header) header += (header.empty() ? "" : ",") + h;
    if (header != kHistoryCsvHeader) {
      throw Error(source + ": line 1: not a vramscope history CSV of schema version " +
                  std::to_string(kHistoryCsvSchemaVersion) + ": the header is\n  " + header + "\nexpected\n  " +
                  std::string(kHistoryCsvHeader));
    }
  };
  std::vector<HistoryEntry> entries;
  const CsvTable table = read_csv(in, source, [&](const CsvTable& t, const std::vector<std::string>& f,
                                                   const std::string& where) {
    if (entries.empty()) check_header(t);  // the columns below are the header's, in its order
    HistoryEntry e;
    e.sequence = parse_uint(f[0], "seq", where);
    e.time_us = parse_double(f[1], "time_us", where);
    const std::string_view name = trim(f[2]);
    bool known = false;
    for (auto a : {TraceAction::Alloc, TraceAction::FreeRequested, TraceAction::FreeCompleted,
                   TraceAction::SegmentAlloc, TraceAction::SegmentFree, TraceAction::SegmentMap,
                   TraceAction::SegmentUnmap, TraceAction::Oom}) {
      if (trace_action_name(a) == name) e.action = a, known = true;
    }
    if (!known) {
      throw Error(where + ": column action: unknown action '" + std::string(name) +
                  "' (expected alloc, free_requested, free_completed, segment_alloc, segment_free, "
                  "segment_map, segment_unmap or oom)");
    }
    e.address = static_cast<std::uintptr_t>(parse_uint(f[3], "address", where));
    e.size = parse_uint(f[4], "size", where);
    e.requested_size = parse_uint(f[5], "requested_size", where);
    e.stream = parse_uint(f[6], "stream", where);
    e.context = at_path(where + ": column phase", [&] { return intern_context(f[7], parse_phase(trim(f[8]))); });
    if (trim(f[9]) != "small" && trim(f[9]) != "large")
      throw Error(where + ": column pool: '" + f[9] + "', expected small or large");
    e.small_pool = trim(f[9]) == "small";
    e.allocated_bytes = parse_uint(f[10], "allocated_bytes", where);
    e.reserved_bytes = parse_uint(f[11], "reserved_bytes", where);
    e.device_used_bytes = parse_uint(f[12], "device_used_bytes", where);
    entries.push_back(e);
  });
  if (table.header.empty()) throw Error(source + ": empty, expected a vramscope history CSV");
  check_header(table);
  return entries;
}

AllocationTrace read_rmm_log(std::istream& in, const std::string& source) {
  AllocationTrace t;
  t.source = source;
  t.format = TraceFormat::RmmCsv;
  struct Cols { std::size_t time, action, pointer, size, stream; };
  std::optional<Cols> cols;
  read_csv(in, source, [&](const CsvTable& table, const std::vector<std::string>& f,
                           const std::string& where) {
    if (!cols) {
      table.column("Thread", source);
      cols = Cols{table.column("Time", source), table.column("Action", source),
                  table.column("Pointer", source), table.column("Size", source),
                  table.column("Stream", source)};
    }
    RecordedEvent e;
    const std::string_view action = trim(f[cols->action]);
    if (action == "allocate") {
      e.action = RecordedAction::Alloc;
    } else if (action == "free" || action == "deallocate") {
      e.action = RecordedAction::FreeRequested;
    } else if (action == "allocate failure" || action == "allocate_failure") {
      e.action = RecordedAction::Oom;
    } else {
      throw Error(where + ": column Action: unknown action '" + std::string(action) +
                  "' (expected allocate, free, deallocate or allocate failure)");
    }
    e.time_us = parse_rmm_time(f[cols->time], where);
    const std::string_view ptr = trim(f[cols->pointer]);
    e.address = ptr == "(nil)" || ptr.empty() ? 0 : parse_uint(ptr, "Pointer", where);
    e.size = parse_uint(f[cols->size], "Size", where);
    e.stream = parse_uint(f[cols->stream], "Stream", where);
    t.events.push_back(e);
  });
  finish(t);
  return t;
}

AllocationTrace read_rmm_log_file(const std::string& path) {
  auto in = open_text(path);
  return read_rmm_log(in, path);
}

AllocationTrace load_trace(const std::string& path, int device) {
  check_trace_file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open '" + path + "' for reading");
  const int first = in.peek();
  if (in.bad()) throw Error(path + ": read error");
  if (first == 0x80) return read_pytorch_snapshot_file(path, device);
  // A CSV header fits in the first few KiB: never read a whole file (a gigabyte of zeros
  // is one "line") to decide that it is not a trace.
  std::string header(4096, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header.size()));
  header.resize(static_cast<std::size_t>(in.gcount()));
  header.resize(std::min(header.size(), header.find('\n')));
  if (header.find("Thread") != std::string::npos && header.find("Pointer") != std::string::npos)
    return read_rmm_log_file(path);
  if (header.find("action") != std::string::npos && header.find("requested_size") != std::string::npos)
    return read_history_trace_file(path);
  throw Error(path + ": unrecognised trace format: expected a PyTorch snapshot pickle "
              "(protocol 2-5), a vramscope history CSV (seq,time_us,action,address,size,"
              "requested_size,stream,module,phase) or an RMM log CSV "
              "(Thread,Time,Action,Pointer,Size,Stream)");
}

}  // namespace mem
