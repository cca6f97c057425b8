// The environment switches of the CUDA kernels as values: which settings each accepts, which
// switches were removed, and the strict parser that resolve_policy (api.cu, the only reader of
// the environment) applies to them. Plain C++ (no CUDA), so the C++ core's tests cover it.
// docs/kernels.md lists the switches; policy.h says what each selects.
#pragma once

#include <cstring>
#include <string>

namespace dualkv::cuda::detail {

// A switch and the settings it accepts (single digits; "01": 0 or 1).
struct EnvSwitch {
  const char* name;
  const char* values;
};

inline constexpr EnvSwitch kEnvSwitches[] = {
    {"DUALKV_FORCE_SM80", "01"},      {"DUALKV_SM90_PINGPONG", "01"},
    {"DUALKV_FUSED_DQ", "01"},        {"DUALKV_SM90_D512_BWD", "01"},
    {"DUALKV_BWD_KEY_ORDER", "0123"}, {"DUALKV_SM80_SMALL_SMEM", "01"},
    {"DUALKV_SM90_D64_TILES", "0123"}};

// A switch this library no longer reads, and what replaced it.
struct RemovedSwitch {
  const char* name;
  const char* instead;
};

inline constexpr RemovedSwitch kRemovedSwitches[] = {
    {"DUALKV_ATOMIC_DQ",
     "dQ is fused into the dK/dV kernel by default at head dim 64/128 on sm_90a; "
     "DUALKV_FUSED_DQ=0 or deterministic=True runs the separate dQ pass"},
    {"DUALKV_SM90_WS",
     "the warp-specialised kernels are the only sm_90a forward and head dim 64/128 backward; "
     "DUALKV_FORCE_SM80=1 runs the sm_80 kernels"},
    {"DUALKV_SM90_BWD_VARIANT",
     "its experimental fused-backward variants measured slower than the default and were "
     "deleted; the default fused backward runs"},
    {"DUALKV_SM90_D512_FWD",
     "its single-CTA head dim 512 forward measured 13% slower than the 2-CTA cluster one and was "
     "deleted; the cluster forward runs (DUALKV_FORCE_SM80=1 runs the sm_80 one)"},
    {"DUALKV_SM90_D256_BWD",
     "the synchronous head dim 256 backward it selected was slower than the warp-specialised one "
     "and was deleted; the warp-specialised backward runs (DUALKV_FORCE_SM80=1 runs the sm_80 "
     "one)"}};

// parse_switch's result for a switch that is unset, empty or blank (the default path runs).
constexpr int kSwitchUnset = -1;

// The setting of switch `name` whose environment value is `value` (null: unset): the digit when
// the value, blanks around it trimmed, is one of the digits the switch accepts (any single digit
// for a name not in kEnvSwitches); kSwitchUnset when it is null or blank. Anything else ("00",
// "false", "2" where 0 or 1 is accepted) is also kSwitchUnset, with *warning set to a message
// naming the switch, the value and the settings accepted (otherwise *warning is left alone).
inline int parse_switch(const char* name, const char* value, std::string* warning) {
  if (value == nullptr) return kSwitchUnset;
  const char* b = value;
  while (*b == ' ' || *b == '\t' || *b == '\n' || *b == '\r') ++b;
  const char* e = b + std::strlen(b);
  while (e > b && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\n' || e[-1] == '\r')) --e;
  if (e == b) return kSwitchUnset;
  const char* values = "0123456789";
  for (const EnvSwitch& s : kEnvSwitches)
    if (std::strcmp(s.name, name) == 0) values = s.values;
  if (e - b == 1 && *b >= '0' && *b <= '9' && std::strchr(values, *b) != nullptr) return *b - '0';
  if (warning != nullptr) {
    std::string accepted;
    for (const char* c = values; *c; ++c) {
      if (!accepted.empty()) accepted += c[1] ? ", " : " or ";
      accepted += *c;
    }
    *warning = std::string("dualkv: ignoring ") + name + "='" + value + "' (accepted: " + accepted +
               "); the default path runs";
  }
  return kSwitchUnset;
}

// The warning for a removed switch that is set to a non-blank value (naming it and the value);
// empty when there is none (`name` not a removed switch, or unset or blank).
inline std::string removed_switch_warning(const char* name, const char* value) {
  if (value == nullptr || value[std::strspn(value, " \t\n\r")] == '\0') return {};
  for (const RemovedSwitch& s : kRemovedSwitches)
    if (std::strcmp(s.name, name) == 0)
      return std::string("dualkv: ") + name + "=" + value + " was removed and is ignored (" +
             s.instead + ")";
  return {};
}

}  // namespace dualkv::cuda::detail
