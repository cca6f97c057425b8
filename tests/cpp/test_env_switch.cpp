// The CUDA kernels' environment switches (src/cuda/env_switch.h, read by resolve_policy): a
// setting is one accepted digit; anything else warns and reads as unset (the default path), so a
// typo never selects a non-default kernel by accident; removed switches warn.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "env_switch.h"

namespace dualkv::cuda::detail {
namespace {

int parse(const char* name, const char* value, std::string* warning) {
  warning->clear();
  return parse_switch(name, value, warning);
}

TEST(EnvSwitch, AcceptedDigits) {
  std::string w;
  EXPECT_EQ(parse("DUALKV_FUSED_DQ", "0", &w), 0);
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(parse("DUALKV_FUSED_DQ", "1", &w), 1);
  EXPECT_EQ(parse("DUALKV_FUSED_DQ", " 0\n", &w), 0);  // blanks around it are ignored
  EXPECT_EQ(parse("DUALKV_SM90_D512_BWD", "1", &w), 1);
  EXPECT_EQ(parse("DUALKV_SM90_D512_BWD", "\t0 ", &w), 0);
  EXPECT_EQ(parse("DUALKV_FORCE_SM80", "1", &w), 1);
  EXPECT_EQ(parse("DUALKV_SM80_SMALL_SMEM", "1", &w), 1);
  EXPECT_EQ(parse("DUALKV_SM80_SMALL_SMEM", "0", &w), 0);
  EXPECT_TRUE(w.empty());
}

TEST(EnvSwitch, UnsetOrBlankIsTheDefaultWithoutWarning) {
  std::string w;
  EXPECT_EQ(parse("DUALKV_FUSED_DQ", nullptr, &w), kSwitchUnset);
  EXPECT_EQ(parse("DUALKV_FUSED_DQ", "", &w), kSwitchUnset);
  EXPECT_EQ(parse("DUALKV_FUSED_DQ", "  ", &w), kSwitchUnset);
  EXPECT_TRUE(w.empty());
}

TEST(EnvSwitch, OtherValuesWarnAndReadAsUnset) {
  // The previous parser read only the first character: "00" and "10" were 0 and 1, "false" and
  // " 1" were silently the default.
  for (const char* v : {"00", "10", "false", "true", "off", "01", "1 1", "-1", "x"}) {
    std::string w;
    EXPECT_EQ(parse("DUALKV_FUSED_DQ", v, &w), kSwitchUnset) << v;
    EXPECT_NE(w.find("DUALKV_FUSED_DQ='" + std::string(v) + "'"), std::string::npos) << w;
    EXPECT_NE(w.find("accepted: 0 or 1"), std::string::npos) << w;
  }
  std::string w;
  // A digit the switch does not take: DUALKV_SM90_D512_BWD has 0 and 1 (its mode 2 was removed);
  // DUALKV_BWD_KEY_ORDER 0 to 3.
  EXPECT_EQ(parse("DUALKV_SM90_D512_BWD", "2", &w), kSwitchUnset);
  EXPECT_NE(w.find("DUALKV_SM90_D512_BWD='2'"), std::string::npos) << w;
  EXPECT_EQ(parse("DUALKV_BWD_KEY_ORDER", "4", &w), kSwitchUnset);
  EXPECT_NE(w.find("accepted: 0, 1, 2 or 3"), std::string::npos) << w;
  EXPECT_EQ(parse("DUALKV_FORCE_SM80", "yes", &w), kSwitchUnset);
  EXPECT_NE(w.find("DUALKV_FORCE_SM80"), std::string::npos) << w;
  // Not a shared-memory size in KB: a setting is one digit.
  EXPECT_EQ(parse("DUALKV_SM80_SMALL_SMEM", "99", &w), kSwitchUnset);
  EXPECT_NE(w.find("DUALKV_SM80_SMALL_SMEM='99' (accepted: 0 or 1)"), std::string::npos) << w;
}

TEST(EnvSwitch, EverySwitchTakesExactlyItsDigits) {
  for (const EnvSwitch& s : kEnvSwitches) {
    EXPECT_GE(std::strlen(s.values), 1u) << s.name;
    for (char c = '0'; c <= '9'; ++c) {
      const char v[2] = {c, 0};
      std::string w;
      const bool listed = std::strchr(s.values, c) != nullptr;
      EXPECT_EQ(parse(s.name, v, &w), listed ? c - '0' : kSwitchUnset) << s.name << "=" << v;
      EXPECT_EQ(w.empty(), listed) << w;
    }
  }
}

TEST(EnvSwitch, RemovedSwitchesWarn) {
  for (const char* name :
       {"DUALKV_ATOMIC_DQ", "DUALKV_SM90_WS", "DUALKV_SM90_D512_FWD", "DUALKV_SM90_D256_BWD"}) {
    for (const char* v : {"0", "1", "5"}) {
      const std::string w = removed_switch_warning(name, v);
      EXPECT_NE(w.find(std::string(name) + "=" + v + " was removed and is ignored"),
                std::string::npos)
          << w;
    }
    EXPECT_TRUE(removed_switch_warning(name, nullptr).empty());
    EXPECT_TRUE(removed_switch_warning(name, " ").empty());
  }
  EXPECT_NE(removed_switch_warning("DUALKV_ATOMIC_DQ", "1").find("DUALKV_FUSED_DQ=0"),
            std::string::npos);
  EXPECT_TRUE(removed_switch_warning("DUALKV_FUSED_DQ", "0").empty());
}

}  // namespace
}  // namespace dualkv::cuda::detail
