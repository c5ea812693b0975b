// runtime/copy_trace.h: the tracer passes every call through and records the copies between start()
// and finish() (on the simulated device); link_use splits a step's time and bytes by which
// directions of the link were busy.
#include "runtime/copy_trace.h"

#include <gtest/gtest.h>

#include <vector>

namespace strata::rt {
namespace {

TEST(CopyTracerTest, RecordsTheCopiesBetweenStartAndFinishOnly) {
  CopyTracer tracer(std::make_unique<rt::SimulatedDevice>());
  rt::StreamHandle a = *tracer.create_stream();
  rt::StreamHandle b = *tracer.create_stream();
  std::vector<char> src(1000, 'x');
  std::vector<char> dst(1000, 0);
  ASSERT_TRUE(tracer.copy_async(dst.data(), src.data(), 10, a).ok());  // before start: untraced
  ASSERT_TRUE(tracer.start(a).ok());
  ASSERT_TRUE(tracer.copy_async(dst.data(), src.data(), 100, a).ok());
  ASSERT_TRUE(tracer.copy_async(dst.data() + 100, src.data(), 300, b).ok());
  absl::StatusOr<std::vector<CopySpan>> spans = tracer.finish();
  ASSERT_TRUE(spans.ok()) << spans.status();
  ASSERT_EQ(spans->size(), 2u);
  EXPECT_EQ((*spans)[0].stream, a);
  EXPECT_EQ((*spans)[0].bytes, 100u);
  EXPECT_EQ((*spans)[1].stream, b);
  EXPECT_EQ((*spans)[1].bytes, 300u);
  for (const CopySpan& s : *spans) {
    EXPECT_GE(s.start_ms, 0);
    EXPECT_GE(s.end_ms, s.start_ms);
  }
  EXPECT_EQ(dst[399], 'x');                                            // the copies themselves ran
  ASSERT_TRUE(tracer.copy_async(dst.data(), src.data(), 10, a).ok());  // after finish: untraced
  spans = tracer.finish();
  ASSERT_TRUE(spans.ok());
  EXPECT_TRUE(spans->empty());
  tracer.destroy_stream(a);
  tracer.destroy_stream(b);
}

TEST(LinkUseTest, SplitsTimeAndBytesByWhichDirectionsWereBusy) {
  const auto h2d = reinterpret_cast<rt::StreamHandle>(1);
  const auto d2h = reinterpret_cast<rt::StreamHandle>(2);
  // H2D copies 0-4 and 4-6 ms (merged: 0-6); D2H 2-8 ms; idle 8-10 ms; the step ends at 10 ms.
  const std::vector<CopySpan> spans = {
      {h2d, 400, 0, 4}, {h2d, 200, 4, 6}, {d2h, 600, 2, 8}, {d2h, 0, 10, 10}};
  const LinkUse u = link_use(spans, h2d, d2h);
  EXPECT_DOUBLE_EQ(u.span_ms, 10);
  EXPECT_DOUBLE_EQ(u.both_ms, 4);                 // 2-6
  EXPECT_DOUBLE_EQ(u.h2d_alone_ms, 2);            // 0-2
  EXPECT_DOUBLE_EQ(u.d2h_alone_ms, 2);            // 6-8
  EXPECT_DOUBLE_EQ(u.neither_ms, 2);              // 8-10
  EXPECT_DOUBLE_EQ(u.h2d_bytes_both, 200 + 200);  // half of the first copy, all of the second
  EXPECT_DOUBLE_EQ(u.h2d_bytes_alone, 200);
  EXPECT_DOUBLE_EQ(u.d2h_bytes_both, 400);  // 4 of its 6 ms
  EXPECT_DOUBLE_EQ(u.d2h_bytes_alone, 200);
}

}  // namespace
}  // namespace strata::rt
