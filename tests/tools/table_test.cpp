// table_test.cpp — the table printer, human units, the progress bar's text and
// the CSV quoting of the vramscope command.
#include <gtest/gtest.h>

#include "progress.hpp"
#include "vramscope/planner/sweep.hpp"
#include "sweep_export.hpp"
#include "sweep_plot.hpp"
#include "table.hpp"
#include "model_args.hpp"
#include "usage_error.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/instrumentation/exports.hpp"  // xml_escape

namespace mem::tools {
namespace {

TEST(Table, AlignsColumnsAndTrimsTrailingBlanks) {
  Table t{{{"name", Align::Left}, {"bytes", Align::Right}, {"note", Align::Left}}};
  t.add_row({"a", "1.00 GiB", ""});
  t.add_row({"longer", "512 B", "x"});
  EXPECT_EQ(t.render(),
            "name       bytes  note\n"
            "----------------------\n"
            "a       1.00 GiB\n"
            "longer     512 B  x\n");
}

TEST(Table, CountsCharactersNotBytes) {
  Table t{{{"k", Align::Left}, {"v", Align::Right}}};
  t.add_row({"—", "1"});
  t.add_row({"ab", "22"});
  EXPECT_EQ(t.render("  "),
            "  k    v\n"
            "  ------\n"
            "  —    1\n"
            "  ab  22\n");
}

TEST(Table, SeparatorAndShortRows) {
  Table t{{{"a", Align::Right}, {"b", Align::Right}}};
  t.add_row({"1"});
  t.add_separator();
  t.add_row({"2", "3"});
  EXPECT_EQ(t.render(), "a  b\n----\n1\n----\n2  3\n");
  EXPECT_THROW(t.add_row({"1", "2", "3"}), mem::Error);
}

TEST(Units, HumanFormats) {
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(512), "512 B");
  EXPECT_EQ(human_bytes(static_cast<std::int64_t>(3 * GiB / 2)), "1.50 GiB");
  EXPECT_EQ(human_bytes(-static_cast<std::int64_t>(20 * MiB)), "-20.00 MiB");
  EXPECT_EQ(human_saving(static_cast<std::int64_t>(GiB), 0.614), "1.00 GiB (61%)");
  EXPECT_EQ(human_saving(0, 0), "0 B");
  // Small savings and losses keep their sign and are not rounded to nothing.
  EXPECT_EQ(human_saving(-static_cast<std::int64_t>(MiB), -0.0003), "-1.00 MiB (-<1%)");
  EXPECT_EQ(human_saving(static_cast<std::int64_t>(MiB), 0.004), "1.00 MiB (<1%)");
  EXPECT_EQ(human_saving(-static_cast<std::int64_t>(GiB), -0.25), "-1.00 GiB (-25%)");
  EXPECT_EQ(human_share(0), "0");
  EXPECT_EQ(human_share(0.125), "12.5%");
  EXPECT_EQ(human_ms(12.34), "12.3 ms");
  EXPECT_EQ(human_ms(250), "250 ms");
  EXPECT_EQ(human_ms(1420), "1.42 s");
  EXPECT_EQ(human_count(11689512), "11,689,512");
  EXPECT_EQ(human_count(999), "999");
  EXPECT_EQ(human_count(-1000), "-1,000");
  EXPECT_EQ(display_width("≈ 1"), 3u);
}

TEST(Progress, RendersBarAndCount) {
  EXPECT_EQ(ProgressBar::render(0, 4, "f32 seg 0", 8), "[........] 0/4 f32 seg 0");
  EXPECT_EQ(ProgressBar::render(2, 4, "x", 8), "[####....] 2/4 x");
  EXPECT_EQ(ProgressBar::render(12, 12, "done", 4), "[####] 12/12 done");
  EXPECT_EQ(ProgressBar::render(1, 12, "", 4), "[....]  1/12 ");
}

TEST(Progress, DisabledBarWritesNothing) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressBar bar{10, f, /*enabled=*/false, std::chrono::milliseconds{0}};
    bar.update(5, "x");
    EXPECT_FALSE(bar.drawn());
  }
  EXPECT_EQ(std::ftell(f), 0);
  std::fclose(f);
}

TEST(Progress, EnabledBarDrawsAfterDelayAndClears) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressBar bar{10, f, /*enabled=*/true, std::chrono::milliseconds{0}};
    bar.update(5, "x");
    EXPECT_TRUE(bar.drawn());
  }
  std::rewind(f);
  char buf[256] = {};
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  const std::string text(buf, n);
  EXPECT_NE(text.find("5/10 x"), std::string::npos);
  EXPECT_EQ(text.substr(text.size() - 4), "\r\x1b[K");  // cleared at the end
  std::fclose(f);
}

TEST(Progress, QuickWorkShowsNoBar) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  ProgressBar bar{10, f, /*enabled=*/true, std::chrono::milliseconds{60'000}};
  bar.update(5, "x");
  EXPECT_FALSE(bar.drawn());
  std::fclose(f);
}

TEST(Csv, QuotesOnlyWhenNeeded) {
  EXPECT_EQ(csv_field("plain"), "plain");
  EXPECT_EQ(csv_field("a,b"), "\"a,b\"");
  EXPECT_EQ(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
  EXPECT_EQ(csv_field("roundup_power2_divisions:[256:1,>:8]"), "\"roundup_power2_divisions:[256:1,>:8]\"");
}

TEST(Csv, HeaderNamesTheColumns) {
  const std::string h = sweep_csv_header();
  EXPECT_EQ(h.substr(0, 80), "model,batch,seq,device,stack,parallel,gradient_checkpointing,dtype,segments,allo");
  for (const char* col : {"max_allocated", "max_reserved", "max_nvidia_smi", "unallocated_at_peak", "saving",
                          "recompute_ratio", "oom_requested", "needs_max_allocated", "peak_communication",
                          "peak_optimizer_temporaries", "peak_workspaces"}) {
    EXPECT_NE(h.find(col), std::string::npos) << col;
  }
}

TEST(Svg, EscapesText) { EXPECT_EQ(xml_escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;"); }

TEST(Segments, AutoRangeAroundSqrt) {
  // 512 modules: sqrt = 22.6, powers of two up to 8 * sqrt = 181.
  EXPECT_EQ(planner::auto_segments(512), (std::vector<std::size_t>{0, 2, 4, 8, 16, 23, 32, 64, 128, 512}));
  // 32 modules: sqrt = 5.66; the powers stop at the module count.
  EXPECT_EQ(planner::auto_segments(32), (std::vector<std::size_t>{0, 2, 4, 6, 8, 16, 32}));
  EXPECT_EQ(planner::auto_segments(1), (std::vector<std::size_t>{0}));
  EXPECT_EQ(planner::auto_segments(4), (std::vector<std::size_t>{0, 2, 4}));
}

TEST(Args, SplitList) {
  EXPECT_EQ(split_list("--dtype", " f32, f16 ,amp "), (std::vector<std::string>{"f32", "f16", "amp"}));
  EXPECT_TRUE(split_list("--dtype", "").empty());
  // An empty item is a typo: an error naming the option, not a silently shorter list.
  for (const char* typo : {"f32,,f16", "f32,", ",f32", " , "}) {
    EXPECT_THROW(split_list("--dtype", typo), UsageError) << typo;
  }
}

TEST(Args, BadNamesAreUsageErrorsNamingWhatIsValid) {
  try {
    parse_precisions("--dtype", "f32,f8");
    FAIL() << "no error";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--dtype"), std::string::npos) << m;
    EXPECT_NE(m.find("f16"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_THROW(planner::check_alloc_conf("max_split_size_mb:abc"), UsageError);
  EXPECT_THROW(planner::check_device("sim:nosuchgpu", nn::ExecMode::DryRun), UsageError);
  EXPECT_NO_THROW(planner::check_device("sim:rtx2080s", nn::ExecMode::DryRun));
}

}  // namespace
}  // namespace mem::tools
