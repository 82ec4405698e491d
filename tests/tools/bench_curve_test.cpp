// tests/tools/bench_curve_test.cpp -- bench-rl's matched-reward reading of a validation curve
// (tools/bench/rl_curve.hpp) on hand-made curves whose answers are worked out below.
#include <gtest/gtest.h>

#include "tests/test_util.hpp"
#include "tools/bench/rl_curve.hpp"

using fp8rl::bench::curve_final;
using fp8rl::bench::curve_of;
using fp8rl::bench::curve_reach;
using fp8rl::bench::eval_point;
using json = nlohmann::json;

namespace {

// evaluations every 10 steps, 0.5 s apart, with these accuracies
std::vector<eval_point> curve(const std::vector<double>& acc) {
  std::vector<eval_point> c;
  for (size_t i = 0; i < acc.size(); ++i) c.push_back({10.0 * double(i + 1), 0.5 * double(i + 1), acc[i]});
  return c;
}

TEST(BenchCurve, OneLuckyEvaluationDoesNotReachTheTarget) {
  // 0.95 alone at step 20: windows of 3 average 0.833, 0.85, 0.883, then 0.9 at step 60
  const auto c = curve({0.80, 0.95, 0.75, 0.85, 0.85, 1.00, 0.70});
  const auto p = curve_reach(c, 0.9, 3);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->step, 60.0);
  EXPECT_EQ(p->elapsed_s, 3.0);
  // with a window of 1 the lucky one counts
  EXPECT_EQ(curve_reach(c, 0.9, 1)->step, 20.0);
}

TEST(BenchCurve, AnExactTieReachesTheTarget) {
  // counts / 200 whose mean is 0.9 exactly, computed in doubles as 0.8999999999999999
  const auto c = curve({0.75, 0.965, 0.985});
  ASSERT_LT((0.75 + 0.965 + 0.985) / 3, 0.9);  // the rounding the tie must survive
  ASSERT_TRUE(curve_reach(c, 0.9, 3).has_value());
  EXPECT_EQ(curve_reach(c, 0.9, 3)->step, 30.0);
  EXPECT_FALSE(curve_reach(c, 0.9001, 3).has_value());
}

TEST(BenchCurve, NoWindowReachingOrTooFewEvaluationsIsNone) {
  EXPECT_FALSE(curve_reach(curve({0.89, 0.89, 0.89, 0.89}), 0.9, 3).has_value());
  EXPECT_FALSE(curve_reach(curve({1.0, 1.0}), 0.9, 3).has_value());  // two evaluations, window 3
  EXPECT_FALSE(curve_reach({}, 0.9, 3).has_value());
  EXPECT_NE(fp8rl::test::error_of([] { (void)curve_reach(curve({1.0}), 0.9, 0); }).find("window 0"), std::string::npos);
}

TEST(BenchCurve, FinalIsTheMeanOfTheLastEvaluations) {
  const auto c = curve({0.1, 0.2, 0.6, 0.8, 1.0});
  EXPECT_DOUBLE_EQ(curve_final(c, 3), 0.8);
  EXPECT_DOUBLE_EQ(curve_final(c, 9), 0.54);  // fewer than asked: all of them
  EXPECT_FALSE(fp8rl::test::error_of([] { (void)curve_final({}, 5); }).empty());
}

TEST(BenchCurve, OfReadsTheEvaluationRowsOfOneRun) {
  const std::vector<json> rows = {{{"step", 1}, {"elapsed_s", 0.1}},
                                  {{"step", 10}, {"elapsed_s", 0.9}, {"val_accuracy", 0.7}},
                                  {{"step", 11}, {"elapsed_s", 1.0}},
                                  {{"step", 20}, {"elapsed_s", 1.8}, {"val_accuracy", 0.8}}};
  const auto c = curve_of(rows);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[1].step, 20.0);
  EXPECT_EQ(c[1].elapsed_s, 1.8);
  EXPECT_EQ(c[1].accuracy, 0.8);
  // two runs' rows concatenated (a step going back) are refused, naming both steps
  std::vector<json> twice = rows;
  twice.push_back({{"step", 10}, {"elapsed_s", 0.9}, {"val_accuracy", 0.7}});
  const std::string e = fp8rl::test::error_of([&] { (void)curve_of(twice); });
  EXPECT_NE(e.find("step 10"), std::string::npos) << e;
  EXPECT_NE(e.find("after step 20"), std::string::npos) << e;
  std::vector<json> same = rows;  // two evaluations at one step: refused as well
  same.push_back({{"step", 20}, {"elapsed_s", 1.9}, {"val_accuracy", 0.8}});
  EXPECT_NE(fp8rl::test::error_of([&] { (void)curve_of(same); }).find("evaluation at step 20.0 after step 20.0"), std::string::npos);
}

}  // namespace
