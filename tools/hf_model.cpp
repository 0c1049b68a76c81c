// hf_model.cpp — finding a Hub model's config.json in the local Hugging Face cache.
#include "hf_model.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <vector>

#include "usage_error.hpp"

namespace mem::tools {
namespace {

namespace fs = std::filesystem;

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : std::string();
}

/// huggingface_hub's constants.py: HF_HUB_CACHE, else the legacy HUGGINGFACE_HUB_CACHE, else
/// HF_HOME/hub, HF_HOME defaulting to $XDG_CACHE_HOME/huggingface or ~/.cache/huggingface.
fs::path hub_cache() {
  if (const std::string v = env("HF_HUB_CACHE"); !v.empty()) return v;
  if (const std::string v = env("HUGGINGFACE_HUB_CACHE"); !v.empty()) return v;
  if (const std::string v = env("HF_HOME"); !v.empty()) return fs::path(v) / "hub";
  if (const std::string v = env("XDG_CACHE_HOME"); !v.empty()) return fs::path(v) / "huggingface" / "hub";
  return fs::path(env("HOME")) / ".cache" / "huggingface" / "hub";
}

/// A repository id as the Hub spells one: [org/]name of letters, digits, '-', '_' and '.',
/// no "--" or ".." and no '-' or '.' at either end (huggingface_hub's validate_repo_id).
bool is_repo_id(std::string_view id) {
  if (id.empty() || id.size() > 96 || id.find("..") != std::string_view::npos || id.find("--") != std::string_view::npos) {
    return false;
  }
  std::size_t slashes = 0;
  for (std::size_t i = 0; i < id.size(); ++i) {
    const char c = id[i];
    const bool first = i == 0 || id[i - 1] == '/';
    const bool last = i + 1 == id.size() || id[i + 1] == '/';
    if (c == '/') {
      if (++slashes > 1 || first || i + 1 == id.size()) return false;
    } else if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
                 (!first && !last && (c == '-' || c == '.')))) {
      return false;
    }
  }
  return true;
}

std::string fetch_hint(const std::string& id) {
  return "`huggingface-cli download " + id + " config.json` (or `hf download`) fetches the config alone, no weights; "
         "or give the folder that holds its config.json, or --hf-config FILE";
}

}  // namespace

std::string find_hf_config(const std::string& name) {
  std::error_code ec;
  if (fs::is_directory(name, ec)) {
    const fs::path config = fs::path(name) / "config.json";
    if (!fs::is_regular_file(config, ec)) {
      throw UsageError("--hf-model " + name + ": the folder has no config.json; give a folder holding one, or a Hub "
                       "model name such as meta-llama/Llama-3.1-8B found in the Hugging Face cache");
    }
    return config.string();
  }
  if (fs::is_regular_file(name, ec)) {
    throw UsageError("--hf-model " + name + ": a file; give its folder, or the file itself with --hf-config");
  }
  if (!is_repo_id(name)) {
    throw UsageError("--hf-model " + name + ": not a folder, and not a Hub model name (org/name of letters, digits, "
                     "'-', '_' and '.')");
  }
  const fs::path cache = hub_cache();
  std::string folder = "models--" + name;
  if (const auto slash = folder.find('/'); slash != std::string::npos) folder.replace(slash, 1, "--");
  const fs::path repo = cache / folder;
  if (!fs::is_directory(repo, ec)) {
    throw UsageError("--hf-model " + name + ": not in the Hugging Face cache (" + cache.string() + "; $HF_HUB_CACHE "
                     "or $HF_HOME set it); " + fetch_hint(name));
  }
  // refs/main: the commit of the main revision, whose snapshot holds the files (the first
  // line of at most 256 bytes, a name of letters, digits, '.', '_' and '-').
  std::string commit(256, '\0');
  if (std::ifstream ref(repo / "refs" / "main", std::ios::binary); ref) {
    ref.read(commit.data(), static_cast<std::streamsize>(commit.size()));
    commit.resize(static_cast<std::size_t>(ref.gcount()));
  } else {
    commit.clear();
  }
  commit = commit.substr(0, commit.find_first_of("\r\n"));
  while (!commit.empty() && commit.back() == ' ') commit.pop_back();
  const bool named = !commit.empty() && commit.size() <= 128 && commit != "." && commit != ".." &&
                     std::all_of(commit.begin(), commit.end(), [](char c) {
                       return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
                     });
  std::vector<fs::path> found;
  if (named) {
    found.push_back(repo / "snapshots" / commit / "config.json");
  } else if (fs::is_directory(repo / "snapshots", ec)) {
    // No main ref (a download of another revision): the one snapshot there, if only one.
    std::size_t seen = 0;
    for (const auto& entry : fs::directory_iterator(repo / "snapshots", ec)) {
      if (++seen > 64) break;
      if (fs::is_regular_file(entry.path() / "config.json", ec)) found.push_back(entry.path() / "config.json");
    }
    if (found.size() > 1) {
      throw UsageError("--hf-model " + name + ": the cache has " + std::to_string(found.size()) + " snapshots of it and "
                       "no main revision (" + (repo / "snapshots").string() + "); give one snapshot's folder");
    }
  }
  if (found.empty() || !fs::is_regular_file(found.front(), ec)) {
    throw UsageError("--hf-model " + name + ": the cache (" + repo.string() + ") has no config.json for its main "
                     "revision; " + fetch_hint(name));
  }
  return found.front().string();
}

}  // namespace mem::tools
